"""torchtitan's `to_hf`, learned once as a renaming plus a row order per tensor.

The trainer publishes its weights HF-named after every step. torchtitan's Llama and Qwen
adapters rename every tensor and reorder the rows of the query and key projections (HF's
rotary layout), copying each of those twice (`reshape`, then `clone`) into fresh memory at
every version, on the path of every weight sync. `HfLayout` runs `to_hf` once on row labels to
learn which rows go where, then writes the reordered tensors into buffers it keeps (one
`index_select` each, no fresh memory) and passes every other tensor through as is.
"""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Source:
    name: str  # the torchtitan tensor the HF tensor is
    rows: torch.Tensor | None  # HF row i is row rows[i] of it; None: the same order


class HfLayout:
    """Maps a torchtitan state dict to HF names and layout, as `adapter.to_hf` does.

    The returned reordered tensors live in buffers that the next call overwrites; every other
    tensor aliases the input. Use `learn` to build one.
    """

    def __init__(self, sources: dict[str, _Source]) -> None:
        self._sources = sources
        self._buffers: dict[str, torch.Tensor] = {}
        self._hf_names = {source.name: hf_name for hf_name, source in sources.items()}

    @classmethod
    def learn(cls, adapter: Any, state_dict: dict[str, torch.Tensor]) -> "HfLayout | None":
        """The layout of `adapter.to_hf` for tensors shaped as in `state_dict`, checked on
        `state_dict` itself; None if `to_hf` does more than rename tensors and reorder their
        rows (then call it directly)."""
        labels, first_rows, row = {}, {}, 0
        for name, tensor in state_dict.items():
            if tensor.dim() == 0:
                return None
            rows = torch.arange(row, row + tensor.shape[0])
            labels[name] = rows.view(-1, *[1] * (tensor.dim() - 1)).expand(tensor.shape)
            first_rows[row] = name
            row += tensor.shape[0]
        sources = {}
        for hf_name, out in adapter.to_hf(labels).items():
            source = _row_order(out, first_rows, state_dict)
            if source is None:
                return None
            sources[hf_name] = source
        layout = cls(sources)
        # Row labels cannot see what happens within a row: the real tensors must agree.
        expected, got = adapter.to_hf(state_dict), layout(state_dict)
        if list(got) != list(expected) or not all(torch.equal(got[k], expected[k]) for k in got):
            return None
        return layout

    def hf_name_of(self, name: str) -> tuple[str, torch.Tensor | None]:
        """The HF name of torchtitan tensor `name`, and its row order (HF row i is row
        rows[i]; None: the same order). Raises KeyError naming a tensor it has not learned."""
        if name not in self._hf_names:
            raise KeyError(f"{name!r} is not a tensor of the learned layout")
        hf_name = self._hf_names[name]
        return hf_name, self._sources[hf_name].rows

    def __call__(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = {}
        for hf_name, source in self._sources.items():
            tensor = state_dict[source.name]
            if source.rows is None:
                hf[hf_name] = tensor
                continue
            out = self._buffers.get(hf_name)
            if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype:
                out = self._buffers[hf_name] = torch.empty_like(tensor)
            hf[hf_name] = torch.index_select(tensor, 0, source.rows, out=out)
        return hf


def _row_order(
    out: torch.Tensor, first_rows: dict[int, str], state_dict: dict[str, torch.Tensor]
) -> _Source | None:
    """Which input the row labels `out` came from, and in which row order; None unless `out`
    holds whole rows of one input, each once."""
    if out.dim() == 0 or out.dtype != torch.int64:
        return None
    labels = out.reshape(out.shape[0], -1)[:, 0]
    name = first_rows.get(int(labels.min()))
    if name is None or out.shape != state_dict[name].shape:
        return None
    rows = labels - labels.min()
    if not torch.equal(out, labels.view(-1, *[1] * (out.dim() - 1)).expand(out.shape)):
        return None  # rows of different inputs, or labels that were computed on
    if not torch.equal(rows.sort().values, torch.arange(len(rows))):
        return None
    identity = torch.equal(rows, torch.arange(len(rows)))
    # index_select wants its indices where the tensor is (a GPU trainer's own weights).
    return _Source(name, None if identity else rows.to(state_dict[name].device))
