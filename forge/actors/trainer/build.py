"""Building the trainer's model: torchtitan's model for the checkpoint (with LoRA adapters if
configured), parallelised by torchtitan's functions, materialised on this rank's device and
loaded with the checkpoint's weights."""

from functools import partial

import torch

from forge.actors.trainer.config import TrainerConfig
from forge.actors.trainer.model import Model
from forge.models import resolve_model
from forge.models.hf_layout import HfLayout
from forge.models.lora import (
    LoRAConfig,
    PeftLayout,
    add_dropout,
    initial_adapters,
    is_adapter,
    with_lora,
)
from forge.models.titan import TitanModel, build, hf_state_dict, titan_model
from forge.models.titan_compat import force_sum_reduction, use_device_type


def build_model(
    cfg: TrainerConfig, lora: LoRAConfig | None, rank: int, world: int, device: torch.device | None
) -> Model:
    """`cfg.model` built (with `lora`'s adapters, if any), sharded over `world` ranks and
    loaded, on `device` (None: the CPU).

    Call on every rank after the process group is up: sharding, loading and, with LoRA,
    learning the adapters' PEFT layout are collectives.
    """
    cuda = device is not None
    path = resolve_model(cfg.model)
    titan = titan_model(path)
    if lora is not None:
        titan = with_lora(titan, lora)
    module = _parallelize(titan, cfg, world, device)
    bf16_on_cpu = not cuda and cfg.dtype == "bfloat16"
    precision = partial(torch.autocast, "cpu", torch.bfloat16, enabled=bf16_on_cpu)
    weights = titan.adapter.from_hf(hf_state_dict(path))
    if lora is not None:
        weights.update(initial_adapters(module, cfg.seed))
        add_dropout(module, lora.dropout)
    _load_full(module, weights)
    model = Model(titan, module, device, rank, world, precision)
    if lora is not None:
        model.peft_layout = _peft_layout(model)
    return model


def _parallelize(
    titan: TitanModel, cfg: TrainerConfig, world: int, device: torch.device | None
) -> torch.nn.Module:
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    cuda = device is not None
    ac = FullAC.Config() if cfg.activation_checkpointing == "full" else None
    if world == 1 and (cfg.dtype == "float32" or not cuda):
        # One rank has nothing to shard, and on a CPU autocast mixes the precision: FSDP
        # would only copy each parameter at every unshard and keep a second, unsharded
        # gradient while micro-batches accumulate (0.5 GB more at SmolLM2's size).
        model = build(titan, meta=True)
        if ac is not None:
            ac.build(dump_folder="/tmp").apply(model)
        return _materialise(model, device)
    use_device_type("cuda" if cuda else "cpu")
    dist_utils.set_spmd_backend("partial_dtensor")
    tp = cfg.tensor_parallel
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world // tp,
        tensor_parallel_degree=tp,
        spmd_backend="partial_dtensor",
    )
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    parallelize = parallelize_llama if titan.family == "llama" else parallelize_qwen3
    model = parallelize(
        build(titan, meta=True),
        parallel_dims=dims,
        training=TrainingConfig(
            mixed_precision_param=cfg.dtype if cuda else "float32",
            mixed_precision_reduce="float32",
        ),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=ac,
        dump_folder="/tmp",
    )
    if not cuda:
        force_sum_reduction(model)
    return _materialise(model, device)


def _materialise(model: torch.nn.Module, device: torch.device | None) -> torch.nn.Module:
    """Allocates a meta-device model's storage and fills its buffers (RoPE cache)."""
    model.to_empty(device=device or "cpu")
    with torch.no_grad():
        model.init_states(buffer_device=device or torch.device("cpu"))
    return model


def _load_full(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a full (unsharded) state dict into a sharded model; every rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, state_dict, options=options)


def _peft_layout(model: Model) -> PeftLayout | None:
    """Where each adapter goes in PEFT's layout, on rank 0 (None on the others): the HF name
    and row order of the weight it adapts. A collective (the base weights are gathered once)."""
    state_dict = model.full_state_dict()
    if model.rank != 0:
        return None
    base = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    layout = HfLayout.learn(model.titan.adapter, base)
    if layout is None:
        raise ValueError(
            f"LoRA: {model.titan.family}'s HF adapter does more than rename tensors and "
            "reorder rows, so its adapters have no PEFT layout here"
        )
    return PeftLayout(layout, [k for k in state_dict if is_adapter(k)])
