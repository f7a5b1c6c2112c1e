"""LoRA in every app: each app's tiny config with `weight_sync.lora`, run by `forge run` to its
end. The exported adapter is a PEFT folder that PEFT loads onto the base model, and it gives the
same next-token distribution as the merged export."""

import json

import pytest
import torch
from helper_runs import finish, forge_run, metrics
from peft import PeftModel
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.integration

FULL_BYTES = 25_000_000  # the tiny Llama's full weights, mostly its 49k-token embedding


@pytest.mark.parametrize("app", ["grpo", "distillation", "sft"])
def test_an_app_trains_lora_and_exports_the_adapter_and_the_merged_model(tmp_path, app):
    run_dir = tmp_path / app
    lora = ("weight_sync.lora={rank: 4, alpha: 8}", "export_merged=true", "steps=3")
    finish(forge_run(app, f"configs/{app}/tiny_cpu.yaml", run_dir, *lora), run_dir)
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3]
    published = [m["weights/bytes"] for m in steps if "weights/bytes" in m]
    assert published and all(b < FULL_BYTES / 50 for b in published), published

    adapter, merged = run_dir / "hf", run_dir / "hf-merged"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()
    folded = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = (torch.log_softmax(m(ids).logits, -1) for m in (with_adapter, folded))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
