"""The run's placement plan: its config's roles placed on its cluster (forge.placement.plan),
with the checks that read the run's config.

`Run.start` calls `plan_run` first; `forge plan APP --config FILE` prints it as a table.
"""

from forge.loop.config import RunConfig
from forge.placement.plan import ClusterShape, Mesh, Plan, PlanError, check_roles, place_roles


def plan_run(cfg: RunConfig, shape: ClusterShape | None = None) -> Plan:
    """Places every role of `cfg` on a cluster of `shape` (default: the config's provisioner's
    `cluster_shape()`) as the Provisioner will, after checking that they fit together.

    Raises:
        PlanError: one line naming the config keys at fault.
    """
    shape = shape or cfg.provisioner.cluster_shape()
    roles = cfg.roles()
    check_roles(roles, shape)
    _check_trainer(cfg)
    plan = place_roles(roles, shape, cfg.placement)
    _check_shm_hosts(cfg, plan.meshes)
    return plan


def _check_trainer(cfg: RunConfig) -> None:
    """One trainer, whose ranks its tensor parallelism divides and its transport reaches (the
    replay buffer's data split follows its ranks: RLConfig)."""
    t = cfg.trainer_resources
    hosts = t.hosts or 1
    world = t.procs * hosts
    ranks = f"trainer_resources.procs {t.procs} x trainer_resources.hosts {hosts} = {world}"
    if t.num_replicas != 1:
        raise PlanError(
            f"trainer_resources.num_replicas must be 1 (one trainer: scale it with procs and "
            f"hosts), got {t.num_replicas}"
        )
    if world % cfg.trainer.tensor_parallel:
        raise PlanError(
            f"trainer.tensor_parallel {cfg.trainer.tensor_parallel} does not divide {ranks} ranks"
        )
    if cfg.weight_sync.transport.kind == "shm" and hosts > 1:
        raise PlanError(
            f"weight_sync.transport.kind 'shm' is same-host only, but trainer_resources.hosts is "
            f"{hosts}: use rdma or torchstore"
        )


def _check_shm_hosts(cfg: RunConfig, meshes: tuple[Mesh, ...]) -> None:
    """With shared memory, every generator must sit on the trainer's host."""
    if cfg.weight_sync.transport.kind != "shm":
        return
    trainer = next(m.placement.hosts for m in meshes if m.role.name == "trainer")
    for m in meshes:
        if m.role.name == "generator" and not set(m.placement.hosts) <= set(trainer):
            raise PlanError(
                f"weight_sync.transport.kind 'shm' is same-host only, but generator replica "
                f"{m.replica} lands on host{m.placement.hosts[0]} and the trainer on "
                f"host{trainer[0]} (generator_resources, trainer_resources): use rdma or torchstore"
            )
