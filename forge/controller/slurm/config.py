"""`provisioner.slurm`: what to ask SLURM for."""

from dataclasses import dataclass, field


@dataclass
class SlurmConfig:
    """What to ask SLURM for: one job whose nodes become the provisioner's hosts."""

    partition: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None  # HH:MM:SS
    account: str | None = None
    qos: str | None = None
    job_name: str = "forge"
    python_exe: str | None = None  # None: this interpreter
    extra_args: list[str] = field(default_factory=list)
    job_start_timeout: int | None = 1800
    exclusive: bool = True  # whole nodes; False shares them (then size cpus_per_task and mem)
    port: int = 22222  # where each node's Monarch worker listens
    log_dir: str | None = None  # for the job's stdout/stderr; None: the current directory
    # The address this driver listens on for its workers; None: its hostname's. Set it where
    # the nodes cannot reach that one (a login node whose hostname names another network).
    driver_address: str | None = None
    max_requeues: int = 3  # forge submit: times a job requeues itself after a lost node
