"""Exporting the trainer's weights as a Hugging Face folder: the model, or with LoRA a PEFT
adapter for the source checkpoint (or the model with its adapters folded in)."""

from forge.actors.trainer.model import Model
from forge.models import resolve_model
from forge.models.lora import LoRAConfig, merge, peft_config


def export_hf(
    model: Model, checkpoint: str, lora: LoRAConfig | None, path: str, merged: bool
) -> str:
    """Writes `model`'s current weights (trained from `checkpoint`, with `lora`'s adapters if
    any) as a Hugging Face folder at `path`; returns `path`.

    Call on every rank: gathering the full weights is a collective. Rank 0 writes the folder
    (the source checkpoint's config and tokenizer, the trained weights) and replaces an
    existing one only once complete. With LoRA the folder is a PEFT adapter, or with `merged`
    the model with its adapters folded in.
    """
    from forge.models.hf_export import save_hf, save_peft

    source = resolve_model(checkpoint)
    if lora is None or merged:
        state_dict = model.full_state_dict()
        if model.rank == 0:
            if lora is not None:
                state_dict = merge(state_dict, lora)
            save_hf(model.titan.adapter.to_hf(state_dict), source, path)
    else:
        adapters = model.full_state_dict(adapters_only=True)
        if model.rank == 0:
            save_peft(model.peft_layout(adapters), peft_config(lora, str(source)), path)
    return path
