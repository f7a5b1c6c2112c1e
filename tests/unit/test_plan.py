"""The placement plan (forge/placement/plan.py, with the run's checks in forge/loop/plan.py):
every shipped config fits the cluster it is written for, each kind of impossible resource
config is one line naming its keys, and the plan is what Run.start gets from the Provisioner
(its spawning run against hosts that start no process)."""

import asyncio
import sys
from types import SimpleNamespace

import pytest
from helper_configs import APPS, CONFIGS, ROOT

import forge.controller.hosts as hosts_module
import forge.controller.provisioner as provisioner
import forge.controller.slurm.launcher as slurm_launcher
import forge.loop.startup as startup_module
from forge.cli import load_app, main
from forge.config import ConfigError, load_config
from forge.loop.plan import plan_run
from forge.placement.plan import ClusterShape, PlanError

CPU_HOST = ClusterShape(hosts=1, gpus_per_host=0, cpus_per_host=2)  # the CPU configs' machine
# The machine each shipped config says it is written for (its header comment).
SHAPES = {
    "qwen3_gpu": ClusterShape(hosts=1, gpus_per_host=8, cpus_per_host=64),
    "qwen3_slurm": ClusterShape(hosts=4, gpus_per_host=8, cpus_per_host=64),
}


def config(name: str, *overrides: str):
    """configs/<name>.yaml loaded onto its app's dataclass, with `overrides`."""
    path = ROOT / "configs" / f"{name}.yaml"
    schema = load_app(ROOT / "apps" / APPS[path.parent.name] / "main.py")[1]
    return load_config(schema, path, list(overrides))


def test_every_shipped_config_has_a_shape():
    assert {p.stem for p in CONFIGS if "cpu" not in p.stem} == set(SHAPES)


@pytest.mark.parametrize("path", CONFIGS, ids=[f"{p.parent.name}/{p.stem}" for p in CONFIGS])
def test_every_shipped_config_fits_its_cluster(path):
    cfg = config(f"{path.parent.name}/{path.stem}")
    plan = plan_run(cfg, SHAPES.get(path.stem, CPU_HOST))
    roles = [m.role.name for m in plan.meshes]
    # A run without eval or rollouts (SFT with eval off) places no generator.
    first = ["trainer", "generator"] if cfg.generates() else ["trainer"]
    assert roles[: len(first)] == first
    replicas = cfg.generator_resources.num_replicas if cfg.generates() else 0
    assert len(plan.of_role("generator")) == replicas
    if path.parent.name != "sft":
        assert plan.of_role("trainer")[0].world_size == cfg.buffer.dp_size


def test_a_run_places_the_roles_it_needs_and_no_other():
    """The roles are the run as data: what the plan places is what Run.start spawns."""

    def names(cfg):
        return [r.name for r in plan_run(cfg, CPU_HOST).roles]

    assert names(config("sft/tiny_cpu")) == ["trainer", "generator", "reward"]  # eval only
    # Environments in replicas; no reward functions (guess-a-number rewards itself): no service.
    agent = ["trainer", "generator", "environment", "buffer", "dataset"]
    assert names(config("agent/tiny_cpu")) == agent
    assert "environment" not in names(config("agent/tiny_cpu", "env_resources=null"))
    sft = config("sft/tiny_cpu", "eval.interval=0")
    assert names(sft) == ["trainer"] and plan_run(sft, CPU_HOST).placement == "split"
    grpo = config("grpo/tiny_cpu", "eval.interval=0")
    assert names(grpo) == ["trainer", "generator", "reward", "buffer", "dataset"]
    distill = config("distillation/tiny_cpu", "eval.interval=0")  # the teacher scores
    assert names(distill) == ["trainer", "generator", "buffer", "dataset", "teacher"]


def test_the_slurm_config_puts_the_trainer_on_two_nodes_and_generators_on_the_others():
    plan = plan_run(config("grpo/qwen3_slurm"), SHAPES["qwen3_slurm"])
    [trainer] = plan.of_role("trainer")
    assert (trainer.hosts, trainer.world_size) == ((0, 1), 16)
    assert trainer.gpus == (tuple(range(8)), tuple(range(8)))
    generators = plan.of_role("generator")
    assert sorted((g.hosts[0], g.gpus[0]) for g in generators) == [
        (h, (i,)) for h in (2, 3) for i in range(8)
    ]
    assert all(len(h.free_gpus) == 0 for h in plan.free)


def test_the_cpu_config_starts_trainer_and_generator_on_both_cores_taking_turns():
    plan = plan_run(config("grpo/smollm2_cpu"), CPU_HOST)  # placement auto, on CPU: colocated
    assert plan.placement == "colocated"
    assert [p.cpus for p in plan.of_role("trainer") + plan.of_role("generator")] == [
        ((0, 1),),
        ((0, 1),),
    ]
    assert plan.resources("trainer").cpus_per_proc == 2  # its thread count
    assert plan.of_role("reward")[0].cpus == ((),)  # unpinned: any core


def test_the_cpu_config_split_pins_trainer_and_generator_to_a_core_each():
    plan = plan_run(config("grpo/smollm2_cpu", "placement=split"), CPU_HOST)
    assert [p.cpus for p in plan.of_role("trainer") + plan.of_role("generator")] == [
        ((0,),),
        ((1,),),
    ]


def test_colocated_gpus_put_each_generator_replica_on_a_trainer_gpu():
    plan = plan_run(config("grpo/qwen3_gpu", "placement=colocated"), SHAPES["qwen3_gpu"])
    [trainer] = plan.of_role("trainer")
    assert trainer.gpus == ((0, 1, 2, 3),)
    assert sorted(g.gpus for g in plan.of_role("generator")) == [((i,),) for i in range(4)]
    assert len(plan.free[0].free_gpus) == 4  # the other four are no one's


IMPOSSIBLE = [
    # (config, overrides, shape, the one line it gives)
    ("grpo/smollm2_cpu", ["trainer_resources.procs=0"], CPU_HOST,
     "trainer_resources.procs must be >= 1, got 0"),
    ("grpo/qwen3_gpu", ["generator_resources.num_replicas=0"], SHAPES["qwen3_gpu"],
     "generator_resources.num_replicas must be >= 1, got 0"),
    ("distillation/tiny_cpu", ["teacher_resources.hosts=0"], CPU_HOST,
     "teacher_resources.hosts must be >= 1, got 0"),
    ("grpo/smollm2_cpu", ["trainer_resources.num_replicas=2"], CPU_HOST,
     r"trainer_resources.num_replicas must be 1 \(one trainer"),
    ("grpo/qwen3_gpu", ["trainer_resources.procs=16"], SHAPES["qwen3_gpu"],
     r"trainer_resources.procs 16 \(one GPU each\) > 8 GPUs per host \(provisioner.gpus_per_host"),
    ("grpo/qwen3_slurm", ["trainer_resources.hosts=5", "buffer.batch_size=1280"],
     SHAPES["qwen3_slurm"],
     "trainer_resources.hosts 5 > provisioner.hosts 4: the mesh would span more hosts"),
    ("grpo/qwen3_slurm", ["generator_resources.num_replicas=17"], SHAPES["qwen3_slurm"],
     "trainer_resources 16 \\+ generator_resources 17 = 33 GPUs > the cluster's 32"),
    ("grpo/smollm2_cpu", ["placement=split", "generator_resources.cpus_per_proc=2"], CPU_HOST,
     r"trainer_resources 1 \+ generator_resources 2 = 3 cores > the cluster's 2"),
    ("grpo/smollm2_cpu", ["placement=colocated", "reward.num_workers=1",
                          "provisioner.cpus_per_host=1", "trainer_resources.cpus_per_proc=0",
                          "generator_resources.num_replicas=2"],
     ClusterShape(hosts=1, gpus_per_host=0, cpus_per_host=1),
     "placement colocated: 1 cores left after the other roles' cpus_per_proc, fewer than"),
    ("grpo/qwen3_gpu", ["placement=colocated", "generator_resources.with_gpus=false"],
     SHAPES["qwen3_gpu"],
     "placement colocated needs trainer_resources.with_gpus and generator_resources.with_gpus"),
    ("grpo/qwen3_slurm",
     ["provisioner.hosts=2", "trainer_resources.hosts=1", "trainer_resources.procs=6",
      "buffer.batch_size=48", "generator_resources.procs=3",
      "generator_resources.num_replicas=3"],
     ClusterShape(hosts=2, gpus_per_host=8, cpus_per_host=64),
     "generator_resources: replica 2 does not fit on 1 adjacent host.s. after trainer_resources"),
    ("grpo/smollm2_cpu", ["generator_resources.with_gpus=true"], CPU_HOST,
     "generator_resources.with_gpus is true, but the cluster's hosts have no GPUs"),
    ("sft/smollm2_cpu", ["trainer_resources.cpus_per_proc=3"], CPU_HOST,
     "trainer_resources.procs 1 x trainer_resources.cpus_per_proc 3 cores > 2 cores per host"),
    ("grpo/qwen3_slurm", ["weight_sync.transport.kind=shm"], SHAPES["qwen3_slurm"],
     "weight_sync.transport.kind 'shm' is same-host only, but trainer_resources.hosts is 2"),
    ("grpo/qwen3_slurm",
     ["weight_sync.transport.kind=shm", "trainer_resources.hosts=1"],
     SHAPES["qwen3_slurm"],
     "weight_sync.transport.kind 'shm' is same-host only, but generator replica 0 lands on "
     "host1"),
    ("grpo/qwen3_slurm", ["trainer.tensor_parallel=3"], SHAPES["qwen3_slurm"],
     "trainer.tensor_parallel 3 does not divide trainer_resources.procs 8 x "
     "trainer_resources.hosts 2 = 16 ranks"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "overrides", "shape", "error"), IMPOSSIBLE)
def test_an_impossible_config_is_one_line_naming_its_keys(name, overrides, shape, error):
    cfg = config(name, *overrides)  # loads: each field alone is fine
    with pytest.raises(PlanError, match=error) as caught:
        plan_run(cfg, shape)
    assert isinstance(caught.value, ConfigError) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["provisioner.hosts=2"], "launcher 'local' has exactly one host, got hosts=2"),
        (["buffer.batch_size=24", "trainer_resources.procs=5"], "batch_size 24 must be a multiple"),
    ],
)
def test_the_loader_refuses_what_a_field_alone_cannot_hold(overrides, error):
    with pytest.raises(ConfigError, match=error):
        config("grpo/smollm2_cpu", *overrides)


def test_the_shape_of_a_config_is_the_provisioners():
    cfg = config("grpo/qwen3_slurm", "provisioner.cpus_per_host=64")
    assert cfg.provisioner.cluster_shape() == ClusterShape(4, 8, 64)
    cfg = config("grpo/qwen3_slurm", "provisioner.slurm.gpus_per_node=null")
    assert cfg.provisioner.cluster_shape().gpus_per_host == 0
    with pytest.raises(PlanError, match="trainer_resources.with_gpus is true"):
        plan_run(cfg)


# --- the plan is what Run.start gets ----------------------------------------------------------


class _Endpoint:
    async def call(self, *args, **kwargs):
        return _Value()

    async def call_one(self, *args, **kwargs):
        return "localhost", 29500  # what the Provisioner's host probe asks for

    choose = call_one


class _Value(dict):
    """A value mesh of the trainer's ranks, all at step 0 (get_step: a fresh run)."""

    def __init__(self):
        super().__init__(rank0=0)

    def item(self, **point):
        return 0


class _Actor:
    def __getattr__(self, endpoint):
        return _Endpoint()


class _Mesh:
    _logging_manager = SimpleNamespace(_logging_mesh_client=None)  # stop_proc_mesh reads it

    @property
    def initialized(self):
        return asyncio.sleep(0)

    def spawn(self, *args, **kwargs):
        return _Actor()

    async def stop(self):
        pass


class _Hosts:
    """Hosts that start no process: each mesh's name and the placement its procs would get."""

    def __init__(self):
        self.spawned: list[tuple[str, object]] = []
        self.state = lambda cached_path: self  # as a monarch job
        self.apply = lambda: None
        self.hosts = self

    def slice(self, hosts):
        return self

    def spawn_procs(self, per_host, name, bootstrap_command=None):
        if bootstrap_command is not None:  # the host probe's mesh has no placement
            bootstrap_command(_Point())
            self.spawned.append((name, _Point.placement))
        return _Mesh()

    def kill(self):
        pass


class _Point:
    rank = 0
    placement = None


class _Stop(Exception):
    """Raised once every mesh is spawned and the trainer asked for its world."""


def _record(placement, rank, *, gpu_host):
    _Point.placement = placement
    return {}


ACTOR = {  # the actor class each role's mesh runs
    "trainer": "TitanTrainer",
    "generator": "Generator",
    "reward": "RewardActor",
    "buffer": "ReplayBuffer",
    "dataset": "DatasetActor",
    "reference": "ReferenceModel",
    "teacher": "ReferenceModel",
}


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("grpo/smollm2_cpu", ["provisioner.cpus_per_host=2"]),
        ("grpo/qwen3_slurm", ["provisioner.cpus_per_host=64"]),
        (
            "grpo/qwen3_gpu",
            ["placement=colocated", "provisioner.gpus_per_host=8", "provisioner.cpus_per_host=64"],
        ),
        ("sft/tiny_cpu", ["provisioner.cpus_per_host=2"]),
        ("sft/tiny_cpu", ["provisioner.cpus_per_host=2", "eval.interval=0"]),  # trainer only
        (
            "distillation/tiny_cpu",
            [
                "provisioner={launcher: process, hosts: 2, cpus_per_host: 2}",
                "weight_sync.transport={kind: torchstore}",
                "trainer_resources.cpus_per_proc=2",
                "generator_resources={num_replicas: 2, cpus_per_proc: 1}",
                "teacher_resources.num_replicas=2",
            ],
        ),
        ("grpo/tiny_cpu", ["reference={model: tiny-llama}", "provisioner.cpus_per_host=2"]),
    ],
)
def test_the_plan_is_what_run_start_places(name, overrides, tmp_path, monkeypatch):
    cfg = config(name, f"run_dir={tmp_path / 'run'}", *overrides)
    hosts = _Hosts()
    monkeypatch.setattr(hosts_module, "this_host", lambda: hosts)
    monkeypatch.setattr(hosts_module, "process_job", lambda count: hosts)
    monkeypatch.setattr(slurm_launcher, "slurm_job", lambda count, cfg: hosts)
    monkeypatch.setattr(slurm_launcher, "cancel_with_driver", lambda job: None)  # none to cancel
    monkeypatch.setattr(slurm_launcher, "in_allocation", lambda: False)
    monkeypatch.setattr(provisioner, "proc_env", _record)
    monkeypatch.setattr(startup_module.RunLogs, "__init__", _stop)
    monkeypatch.setattr(startup_module, "make_transport", lambda cfg: _Transport())
    # The GPU configs' checkpoints are not on this machine: a tokenizer stands in for theirs,
    # and their models are taken as found.
    monkeypatch.setattr(
        startup_module, "load_tokenizer", lambda model: SimpleNamespace(eos_token="")
    )
    monkeypatch.setattr(startup_module, "check_available", lambda cfg: None)
    if cfg.weight_sync.transport.kind == "torchstore":
        from forge.weights import torchstore_compat

        monkeypatch.setattr(torchstore_compat, "initialize", _nothing)
    app = sys.modules["forge_app"]  # `config` imported the app file
    run = next(v for k, v in vars(app).items() if k in {"GRPO", "SFT", "Distill"})
    plan = plan_run(cfg)

    async def start():
        with pytest.raises(_Stop):  # a failed start stops what it started
            await run.start(cfg)

    asyncio.run(start())

    def where(p):
        return p.hosts, p.gpus, p.cpus

    assert sorted((n, where(p)) for n, p in hosts.spawned) == sorted(
        (ACTOR[m.role.name], where(m.placement)) for m in plan.meshes
    )
    t = cfg.trainer_resources
    assert cfg.trainer_ranks == t.procs * (t.hosts or 1)  # Run.world: a batch list for each


class _Transport:
    async def clear(self):
        pass


async def _nothing():
    pass


def _stop(*args, **kwargs):
    raise _Stop


# --- forge plan -------------------------------------------------------------------------------


GRPO = str(ROOT / "apps/grpo/main.py")


def test_forge_plan_prints_the_table(capsys):
    main(
        [
            "plan",
            GRPO,
            "--config",
            str(ROOT / "configs/grpo/qwen3_slurm.yaml"),
            "--cpus-per-host=64",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cluster: 4 hosts x 8 GPUs, 64 cores"
    assert out[1] == (
        "placement: split (auto: GPU placements are not calibrated, so the configured split)"
    )
    assert out[2].split() == ["role", "replicas", "hosts", "procs/host", "GPUs", "cores", "world"]
    trainer = ["trainer", "1", "0-1", "8", "host0:", "0-7,", "host1:", "0-7", "any", "16"]
    assert out[3].split() == trainer
    assert out[4].split()[:3] == ["generator", "16", "2-3"]


def test_forge_plan_refuses_an_impossible_config_with_one_line(capsys):
    cpu = str(ROOT / "configs/grpo/smollm2_cpu.yaml")
    shape = ["--hosts=1", "--gpus-per-host=0", "--cpus-per-host=2"]
    with pytest.raises(SystemExit) as exit:
        main(["plan", GRPO, "--config", cpu, *shape, "placement=split",
              "trainer_resources.cpus_per_proc=2"])  # fmt: skip
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        "forge: config error: trainer_resources 2 + generator_resources 1 = 3 cores > the "
        "cluster's 2 (1 hosts x 2; provisioner.hosts): the meshes would overlap\n"
    )


def cache_costs(tmp_path, monkeypatch, costs) -> None:
    """`costs` cached for configs/grpo/smollm2_cpu.yaml on 2 cores, in a cache of its own."""
    from forge.placement import calibration

    monkeypatch.setattr(calibration, "cache_path", lambda: tmp_path / "calibration.json")
    calibration.save(calibration.cache_key(config("grpo/smollm2_cpu").workload(), 2), costs)


def forge_plan_cpu(capsys, *overrides: str) -> list[str]:
    cpu = str(ROOT / "configs/grpo/smollm2_cpu.yaml")
    shape = ["--hosts=1", "--gpus-per-host=0", "--cpus-per-host=2"]
    main(["plan", GRPO, "--config", cpu, *shape, *overrides])
    return capsys.readouterr().out.splitlines()


def test_forge_plan_predicts_each_placement_from_the_cached_calibration(
    capsys, tmp_path, monkeypatch
):
    from forge.placement import calibration
    from forge.placement.cost_model import PhaseCosts

    monkeypatch.setattr(calibration, "cache_path", lambda: tmp_path / "calibration.json")
    assert forge_plan_cpu(capsys)[-1] == (
        "pipeline model: not calibrated on this machine for this workload yet"
    )
    costs = PhaseCosts({1: 2.0, 2: 1.5}, {1: 20.0, 2: 11.0}, {1: 0.0, 2: 0.0}, 0.5)
    cache_costs(tmp_path, monkeypatch, costs)
    lines = forge_plan_cpu(capsys)
    assert lines[-3] == (
        "pipeline model (calibration cached here): placement auto takes colocated: margin 7.5 "
        "s/step over split 1+1, spread 1.0 s/step (5%)"
    )
    assert lines[-2].split() == ["*", "colocated", "13.0", "s/step", "policy", "age", "0.0"]
    assert lines[-1].split()[:4] == ["split", "1+1", "20.5", "s/step"]


# Generation far cheaper on one core than on two: the async split is fastest.
SPLIT_FASTEST = ({2: 13.3, 1: 1.95}, {2: 21.3, 1: 5.18}, {2: 0.65, 1: 0.19}, 1.08)


def test_forge_plan_says_auto_moves_to_the_split_it_stars(capsys, tmp_path, monkeypatch):
    from forge.placement.cost_model import PhaseCosts

    cache_costs(tmp_path, monkeypatch, PhaseCosts(*SPLIT_FASTEST))
    lines = forge_plan_cpu(capsys)
    assert lines[1].startswith("placement: colocated (auto: starts on every core")
    assert lines[-3] == (
        "pipeline model (calibration cached here): placement auto takes split 1+1: margin "
        "29.2 s/step over colocated, spread 1.8 s/step (5%); the run starts colocated, then "
        "moves"
    )
    assert lines[-1].split()[:5] == ["*", "split", "1+1", "6.5", "s/step"]


def test_forge_plan_stars_colocated_where_the_split_wins_inside_the_spread(
    capsys, tmp_path, monkeypatch
):
    from forge.placement.cost_model import PhaseCosts

    # Split 1+1 predicted 28.5 s/step against colocated's 30.7; measurements 10% apart.
    costs = PhaseCosts({2: 10.0, 1: 28.5}, {2: 20.2, 1: 27.0}, {2: 0.0, 1: 0.0}, 0.5, 0.1)
    cache_costs(tmp_path, monkeypatch, costs)
    lines = forge_plan_cpu(capsys, "trainer.exact_mismatch=false")
    assert lines[-3] == (
        "pipeline model (calibration cached here): placement auto takes colocated: split 1+1 "
        "is faster by a margin of 2.2 s/step, inside the spread of 3.1 s/step (10%): the "
        "simpler placement wins"
    )
    assert lines[-2].split()[:2] == ["*", "colocated"]


def test_forge_plan_recalibrate_drops_the_cached_costs_and_says_so(capsys, tmp_path, monkeypatch):
    from forge.placement import calibration
    from forge.placement.cost_model import PhaseCosts

    cache_costs(tmp_path, monkeypatch, PhaseCosts(*SPLIT_FASTEST))
    lines = forge_plan_cpu(capsys, "--recalibrate")
    assert lines[-2:] == [
        "recalibrate: the cached phase costs are dropped; the next auto run measures them",
        "pipeline model: not calibrated on this machine for this workload yet",
    ]
    key = calibration.cache_key(config("grpo/smollm2_cpu").workload(), 2)
    assert calibration.load(key) is None
    lines = forge_plan_cpu(capsys, "--recalibrate")
    assert lines[-2] == (
        "recalibrate: nothing cached here for this workload; the next auto run measures"
    )


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_forge_plan_stars_the_configured_placement_the_run_takes(
    placement, capsys, tmp_path, monkeypatch
):
    """An explicit placement is the one the run takes (`Placer.fit`), the fastest or not."""
    from forge.placement.cost_model import PhaseCosts

    cache_costs(tmp_path, monkeypatch, PhaseCosts(*SPLIT_FASTEST))
    lines = forge_plan_cpu(capsys, f"placement={placement}")
    starred = [line.split()[1] for line in lines[-2:] if line.split()[0] == "*"]
    assert starred == [placement]
    assert (
        lines[-3]
        == "pipeline model (calibration cached here): "
        + {
            "colocated": "placement colocated; split 1+1 is predicted faster (placement auto)",
            "split": "placement split 1+1",
        }[placement]
    )
