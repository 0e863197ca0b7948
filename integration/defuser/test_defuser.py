"""Defuser 0.0.28 (the expert splitter GPTQModel uses) beside layerswap's '-quant', on the same tiny checkpoints:
the facts docs/quantizers.md's side-by-side table states. Both split stock fused experts into nn.Linear layers with
the same outputs; they differ in when (Defuser's `convert_model` after loading, layerswap's bundle while loading),
in what a save writes (mixtral), and in undoing it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from transformers import AutoModelForCausalLM

import defuser
import layerswap
from peak_memory import measure, record, save_larger_checkpoint
from tiny_checkpoints import logits

TOOLS = ("layerswap", "defuser")


def _split(path, model_type: str, tool: str) -> nn.Module:
    if tool == "layerswap":
        with layerswap.use_bundle(f"{model_type}-quant"):
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert defuser.convert_model(model)
    return model


def _expert_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for name, m in model.named_modules() if ".experts." in name and isinstance(m, nn.Linear)]


@pytest.mark.parametrize("tool", TOOLS)
def test_experts_become_linear_layers_with_the_same_outputs(tiny_checkpoint, tool):
    model_type, path = tiny_checkpoint
    expected = logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    model = _split(path, model_type, tool)
    assert len(_expert_linears(model)) == 2 * 8 * 3
    torch.testing.assert_close(logits(model), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tool", TOOLS)
def test_what_an_unquantized_save_writes(tiny_checkpoint, tool, tmp_path):
    # layerswap saves the stock checkpoint back bit for bit, for every family; Defuser does for qwen2_moe and
    # qwen3_moe, but writes mixtral's experts under names stock transformers does not load (its experts are then
    # left uninitialised, with only the load report to say so).
    model_type, path = tiny_checkpoint
    _split(path, model_type, tool).save_pretrained(tmp_path)
    saved, original = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
    identical = saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    if tool == "defuser" and model_type == "mixtral":
        assert not identical
        assert info["missing_keys"] and len(info["unexpected_keys"]) == 2 * 8 * 3
    else:
        assert identical
        assert not any(info.values()), info


@pytest.mark.parametrize("tool", TOOLS)
def test_torchao_after_loading_quantizes_every_expert(tiny_checkpoint, tool):
    model_type, path = tiny_checkpoint
    model = _split(path, model_type, tool)
    quantize_(model, Int8WeightOnlyConfig())
    linears = _expert_linears(model)
    assert len(linears) == 2 * 8 * 3
    assert all(type(linear.weight).__name__ != "Parameter" for linear in linears)


def test_replace_fused_blocks_is_global_with_no_undo_and_disable_bundle_undoes_the_bundle(tiny_checkpoint):
    # In a subprocess: Defuser patches transformers' classes for the rest of the process.
    model_type, path = tiny_checkpoint
    script = textwrap.dedent(
        f"""
        import defuser, layerswap
        from transformers import AutoModelForCausalLM
        experts = lambda: type(AutoModelForCausalLM.from_pretrained({str(path)!r}).model.layers[0].mlp).__name__
        stock = experts()
        with layerswap.use_bundle("{model_type}-quant"):
            assert experts() == stock  # the bundle swaps the experts inside the block, not the block
        assert experts() == stock
        assert defuser.replace_fused_blocks("{model_type}")
        replaced = experts()
        assert replaced != stock
        assert sorted(n for n in defuser.__all__) == ["convert_model", "replace_fused_blocks"]  # no undo
        print(stock, replaced)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


PEAK_SPLITS = ("stock", "layerswap", "Defuser convert_model", "Defuser replace_fused_blocks")


def test_peak_memory_of_splitting_while_loading_and_after(tiny_checkpoint, tmp_path, measured):
    # docs/quantizers.md's peak-memory row: a larger random checkpoint (288 MiB of fp32 experts, saved per expert
    # as stock saves them), each load in a fresh process after a warm-up load of the tiny one
    # (integration/peak_memory.py says how it is measured).
    model_type, tiny = tiny_checkpoint
    path = save_larger_checkpoint(model_type, tmp_path)
    results = {split: measure(path, model_type, split, warmup=tiny) for split in PEAK_SPLITS}
    record(measured, model_type, results)
    experts = results["stock"]["expert_mib"]
    assert all(r["expert_linears"] == 3 * 32 * 3 for split, r in results.items() if split != "stock")
    # A stock load copies every expert out of the checkpoint into the fused tensors: its peak holds both.
    # Splitting while loading keeps the per-expert tensors as the checkpoint holds them (views of the mmapped file).
    for split in ("layerswap", "Defuser replace_fused_blocks"):
        assert results[split]["peak_mib"] < results["stock"]["peak_mib"] - 0.8 * experts, split
    # Splitting after loading starts from the stock load's peak.
    assert results["Defuser convert_model"]["peak_mib"] > results["stock"]["peak_mib"] - 0.1 * experts
