"""Services: replicas of one actor behind a single handle."""

from forge.controller.service.replica import ReplicaState
from forge.controller.service.service import (
    NoHealthyReplicaError,
    ReplicaDiedError,
    ReplicaHungError,
    ReplicasLostError,
    Service,
    ServiceConfig,
    ServiceEndpoint,
)

__all__ = [
    "NoHealthyReplicaError",
    "ReplicaDiedError",
    "ReplicasLostError",
    "ReplicaHungError",
    "ReplicaState",
    "Service",
    "ServiceConfig",
    "ServiceEndpoint",
]
