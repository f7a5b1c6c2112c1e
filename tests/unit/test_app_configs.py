"""Every shipped app config loads onto its app's dataclass (GPU and SLURM ones included, which
cannot run here): a wrong key or type in them fails this test, not a cluster job."""

from pathlib import Path

import pytest
from helper_configs import APPS, CONFIGS, ROOT, SERVE_CONFIGS

from forge.cli import load_app
from forge.config import ConfigError, FieldError, load_config
from forge.envs.config import EnvConfig
from forge.observability import ConsoleBackend


def schema(config: Path) -> type:
    return load_app(ROOT / "apps" / APPS[config.parent.name] / "main.py")[1]


def test_every_config_folder_belongs_to_an_app():
    assert {p.parent.name for p in CONFIGS} == set(APPS)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=[p.stem for p in SERVE_CONFIGS])
def test_serve_config_loads_and_a_wrong_key_is_one_line(path):
    from forge.serve.tinker.config import ServeConfig

    cfg = load_config(ServeConfig, path, available=True)
    assert cfg.host == "127.0.0.1" and cfg.base_models
    with pytest.raises(ConfigError, match=r"command line: max_model: .*max_models"):
        load_config(ServeConfig, path, ["max_model=3"])
    with pytest.raises(ConfigError, match="command line: base_models: must be at least one"):
        load_config(ServeConfig, path, ["base_models=[]"])


@pytest.mark.parametrize("path", CONFIGS, ids=[f"{p.parent.name}/{p.stem}" for p in CONFIGS])
def test_app_config_loads(path):
    cfg = load_config(schema(path), path)
    assert (
        cfg.trainer.objective
        == {"grpo": "grpo", "agent": "grpo", "distillation": "distill", "sft": "sft"}[
            path.parent.name
        ]
    )
    if path.parent.name != "sft":
        assert cfg.buffer.batch_size % cfg.group_size == 0
        assert cfg.trainer.temperature == cfg.generator.sampling.temperature


def test_a_typo_in_an_app_config_is_one_line_naming_it():
    grpo = ROOT / "configs" / "grpo" / "smollm2_cpu.yaml"
    with pytest.raises(ConfigError, match="command line: trainer.optimizer.learning_rate"):
        load_config(schema(grpo), grpo, ["trainer.optimizer.learning_rate=1e-5"])


def test_an_app_refuses_an_objective_it_cannot_train():
    distill = ROOT / "configs" / "distillation" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="trainer.objective: set by the app"):
        load_config(schema(distill), distill, ["trainer.objective=grpo"])


def test_the_config_derives_the_trainers_objective_ranks_and_checkpoint_folder():
    grpo = ROOT / "configs" / "grpo" / "tiny_cpu.yaml"
    cfg = load_config(schema(grpo), grpo, ["run_dir=runs/x", "trainer_resources.procs=2"])
    assert (cfg.trainer.objective, cfg.buffer.dp_size) == ("grpo", 2)
    assert cfg.trainer.checkpoint.folder == "runs/x/checkpoints"  # no config needs to say it
    off = load_config(schema(grpo), grpo, ["run_dir=runs/x", "trainer.checkpoint.enabled=false"])
    assert off.trainer.checkpoint.folder is None
    slurm = ROOT / "configs" / "grpo" / "qwen3_slurm.yaml"  # 8 procs x 2 hosts
    assert load_config(schema(slurm), slurm).buffer.dp_size == 16
    with pytest.raises(ConfigError, match="buffer.batch_size 8 must be a multiple of .* = 3"):
        load_config(schema(grpo), grpo, ["trainer_resources.procs=3"])


def test_grpo_refuses_a_run_where_nothing_rewards():
    grpo = ROOT / "configs" / "grpo" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="ToolTask\\) rewards nothing itself"):
        load_config(schema(grpo), grpo, ["reward.functions=[]"])
    agent = ROOT / "configs" / "agent" / "tiny_cpu.yaml"  # guess-a-number rewards itself
    assert load_config(schema(agent), agent).reward.functions == []


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["teacher_top_k=-1"], "teacher_top_k must be >= 0"),
        (["teacher_top_k=65", "teacher.backend=vllm"], "teacher_top_k must be <= 64"),
        (["teacher_top_k=8", "trainer.loss.is_correction=tis"], "is_correction to 'none'"),
    ],
)
def test_distillation_refuses_a_top_k_it_cannot_serve(overrides, error):
    distill = ROOT / "configs" / "distillation" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=error):
        load_config(schema(distill), distill, overrides)


def test_a_run_publishes_weights_in_its_engines_dtype():
    grpo = ROOT / "configs" / "grpo" / "smollm2_cpu.yaml"
    assert load_config(schema(grpo), grpo).weight_sync.dtype == "float32"
    gpu = ROOT / "configs" / "grpo" / "qwen3_gpu.yaml"
    cfg = load_config(schema(gpu), gpu)
    assert cfg.weight_sync.dtype == "bfloat16"
    # The trainer publishes in, and the engines run, the one dtype the section holds.
    roles = {role.name: role.args for role in cfg.roles()}
    assert roles["trainer"][1] is roles["generator"][1] is cfg.weight_sync
    for old in ("generator.dtype=bfloat16", "trainer.publish_dtype=float32"):
        with pytest.raises(ConfigError, match="moved to weight_sync.dtype"):
            load_config(schema(grpo), grpo, [old])


@pytest.mark.parametrize(
    ("app", "override", "error"),
    [
        ("grpo", "dataset.task=chain_sum", "dataset: renamed to data"),
        ("distillation", "dataset={size: 10}", "dataset: renamed to data"),
        ("grpo", "eval.dataset={task: chain_sum}", "eval.dataset: renamed to eval.data"),
        ("sft", "eval.seed=3", "eval.seed: removed: eval rows are held out of data"),
        ("sft", "data.local={path: rows.jsonl}", "data.local: removed: data.source: local"),
        ("sft", "data.reasoning_gym.task=chain_sum", "data.reasoning_gym: removed: a reasoning"),
        ("sft", "data.answer_template='{answer}'", "data.answer_template: moved to target.templ"),
        ("sft", "data.completion_column=c", "data.completion_column: moved to target.column"),
        ("grpo", "trainer.transport.kind=rdma", "trainer.transport: moved to weight_sync.transp"),
        ("sft", "generator.transport={kind: shm}", "generator.transport: moved to weight_sync.t"),
        ("grpo", "trainer.lora.rank=16", "trainer.lora: moved to weight_sync.lora"),
        ("distillation", "generator.lora={rank: 4}", "generator.lora: moved to weight_sync.lora"),
        ("grpo", "trainer.publish_dtype=float16", "trainer.publish_dtype: moved to weight_sync.d"),
        ("sft", "generator.dtype=bfloat16", "generator.dtype: moved to weight_sync.dtype"),
        ("grpo", "trainer.objective=grpo", r"trainer.objective: set by the app \(its Config.OBJ"),
        ("sft", "trainer.objective=sft", r"trainer.objective: set by the app \(its Config.OBJE"),
        ("grpo", "buffer.dp_size=2", r"buffer.dp_size: derived from trainer_resources \(procs"),
        (
            "distillation",
            "trainer.checkpoint.folder=null",
            "trainer.checkpoint.folder: derived: .* trainer.checkpoint.enabled: false turns them",
        ),
        ("sft", "trainer.checkpoint={folder: ckpt}", "trainer.checkpoint.folder: derived: a run"),
    ],
)
def test_an_old_spelling_names_the_new_key(app, override, error):
    path = ROOT / "configs" / app / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=f"^command line: {error}"):
        load_config(schema(path), path, [override])


def test_every_app_reads_the_same_data_section():
    override = ["data={source: local, path: rows.jsonl, prompt_column: q, answer_column: a}"]
    sections = {
        app: load_config(schema(path), path, override).data
        for app in APPS
        for path in [ROOT / "configs" / app / "tiny_cpu.yaml"]
    }
    assert len({repr(s) for s in sections.values()}) == 1
    assert sections["sft"].path == "rows.jsonl" and sections["grpo"].prompt_column == "q"


def test_an_old_config_file_names_the_keys_the_config_now_derives(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("trainer:\n  objective: distill\n  checkpoint: {folder: '${run_dir}/ckpt'}\n")
    distill = ROOT / "configs" / "distillation" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=f"^{old}: trainer.objective: set by the app") as e:
        load_config(schema(distill), old)
    assert "\n" not in str(e.value)
    old.write_text("buffer: {batch_size: 16, dp_size: 2}\n")
    with pytest.raises(ConfigError, match=f"^{old}: buffer.dp_size: derived from trainer_resou"):
        load_config(schema(distill), old)


def test_an_old_config_file_names_the_weight_sync_key(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("generator: {transport: {kind: shm}}\ntrainer: {transport: {kind: shm}}\n")
    grpo = ROOT / "configs" / "grpo" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=f"^{old}: generator.transport: moved to weight_sync"):
        load_config(schema(grpo), old)


def test_the_sft_console_shows_the_trainers_throughput_not_the_generators():
    """SFT's generators answer only the held-out eval: their tokens/s is 0 between evals."""
    sft = ROOT / "configs" / "sft" / "tiny_cpu.yaml"
    line = ConsoleBackend(load_config(schema(sft), sft).metrics.console_keys).format(
        1, {"train/loss": 2.5, "train/tokens_per_s": 2351.0, "generator/tokens_per_s": 0.0}
    )
    assert line == "step 1 | train/loss 2.5 | trained tok/s 2351"


def test_the_guard_can_be_turned_off_as_yaml_spells_it(tmp_path):
    # YAML 1.1 reads `off` as false: the loader takes it as the choice it spells.
    grpo = ROOT / "configs" / "grpo" / "tiny_cpu.yaml"
    assert (
        load_config(schema(grpo), grpo, ["trainer.guard.action=off"]).trainer.guard.action == "off"
    )
    own = tmp_path / "off.yaml"
    own.write_text(grpo.read_text().replace("trainer:\n", "trainer:\n  guard: {action: off}\n", 1))
    assert load_config(schema(grpo), own).trainer.guard.action == "off"


class AnyOptions:
    """An environment factory that takes any option."""

    def __init__(self, row: dict, **options: object) -> None:
        self.options = options


@pytest.mark.parametrize(
    ("factory", "options", "error"),
    [
        ("forge.envs.tasks:GuessNumber", {"high": 4}, None),
        ("test_app_configs:AnyOptions", {"anything": 1}, None),
        ("forge.envs.tasks:GuessNumber", {"hgih": 4}, r"options.hgih: .* \(did you mean 'high'"),
        ("forge.envs.tasks:ToolTask", {"colour": 1}, r"options.colour: .* \(it takes: tools\)"),
        ("helper_envs:SlowGuess", {"high": 4}, "options: .*missing a required argument: 'step_s'"),
        ("forge.envs.tasks:Nope", {}, "factory: cannot import environment factory"),
    ],
)
def test_an_environments_options_are_checked_against_its_factory(factory, options, error):
    env = EnvConfig(factory, options)
    if error is None:
        env.check_available()
        return
    with pytest.raises(FieldError, match=f"^{error}"):
        env.check_available()
