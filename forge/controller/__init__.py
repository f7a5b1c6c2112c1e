"""The Monarch layer: actors, placement, provisioning and services. Knows nothing of RL."""

from forge.controller.actor import ActorOptions, ForgeActor
from forge.controller.endpoints import retry_safe
from forge.controller.monarch_compat import SupervisionError
from forge.controller.provisioner import (
    HostLostError,
    ProcessConfig,
    Provisioner,
    ProvisionerConfig,
    get_provisioner,
    init_provisioner,
    shutdown,
)
from forge.controller.service import Service, ServiceConfig
from forge.controller.slurm.config import SlurmConfig

__all__ = [
    "ActorOptions",
    "ForgeActor",
    "HostLostError",
    "ProcessConfig",
    "Provisioner",
    "ProvisionerConfig",
    "Service",
    "ServiceConfig",
    "SupervisionError",
    "SlurmConfig",
    "get_provisioner",
    "init_provisioner",
    "retry_safe",
    "shutdown",
]
