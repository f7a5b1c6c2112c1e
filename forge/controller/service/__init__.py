"""Services: replicas of one actor behind a single handle."""

from forge.controller.service.replica import ReplicaState
from forge.controller.service.service import (
    NoHealthyReplicaError,
    ReplicaDiedError,
    Service,
    ServiceConfig,
    ServiceEndpoint,
)

__all__ = [
    "NoHealthyReplicaError",
    "ReplicaDiedError",
    "ReplicaState",
    "Service",
    "ServiceConfig",
    "ServiceEndpoint",
]
