"""`provisioner.slurm`: what to ask SLURM for."""

from dataclasses import dataclass, field

from forge.config import at_least


@dataclass
class SlurmConfig:
    """What to ask SLURM for: one job whose nodes become the provisioner's hosts.

    Args:
        partition: sbatch --partition; None: the cluster's default.
        gpus_per_node: sbatch --gpus-per-node, also the GPUs each host counts; None: none asked.
        cpus_per_task: sbatch --cpus-per-task (one task per node); None: SLURM's default.
        mem: sbatch --mem, memory per node ("64G"); None: SLURM's default.
        time: sbatch --time, the job's time limit (HH:MM:SS); None: the partition's.
        account: sbatch --account, charged for the job; None: the cluster's default.
        qos: sbatch --qos, the job's quality of service; None: the cluster's default.
        job_name: sbatch --job-name.
        python_exe: the python the nodes' processes run; None: this interpreter.
        extra_args: further sbatch options, each a string starting with "-".
        job_start_timeout: seconds the slurm launcher waits for its job to start running;
            None: forever.
        exclusive: whole nodes; false shares them (then size cpus_per_task and mem).
        port: where each node's Monarch worker listens.
        log_dir: where the slurm launcher's job writes its stdout and stderr; None: the
            current directory.
        driver_address: the address this driver listens on for its workers; None: its
            hostname's. Set it where the nodes cannot reach that one (a login node whose
            hostname names another network).
        max_requeues: how many times a `forge submit` job requeues itself, after a lost node or
            its time limit's warning.
        warning_s: how many seconds before the job's time limit SLURM warns the driver of a
            `forge submit` job (SIGUSR1): the run then ends as after Ctrl-C (a final
            checkpoint) and the job requeues itself to go on from there. None: no warning.
    """

    partition: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "forge"
    python_exe: str | None = None
    extra_args: list[str] = field(default_factory=list)
    job_start_timeout: int | None = 1800
    exclusive: bool = True
    port: int = 22222
    log_dir: str | None = None
    driver_address: str | None = None
    max_requeues: int = 3
    warning_s: int | None = 180

    def __post_init__(self) -> None:
        at_least(self, 0, "gpus_per_node", "max_requeues")
        at_least(self, 1, "cpus_per_task", "job_start_timeout", "port", "warning_s")
