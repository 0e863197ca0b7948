"""llm-compressor `oneshot` GPTQ W4A16 over tiny MoE models loaded under '<family>-quant', then save and reload.

The calibration set is 4 tokens: with top_k 2 of 8 experts, several experts of each layer get no routed token.
llm-compressor calibrates every expert on every token by default (`moe_calibrate_all_experts=True`); layerswap's
experts honour that switch (layerswap/swaps/quant/all_experts.py). Without it, those experts are quantized with
uninitialised scales.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modeling.moe.linearize import linearize_moe, repack_moe
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

import layerswap
from layerswap.swaps.quant import LinearExperts
from peak_memory import measure, record, save_larger_checkpoint

CALIBRATION_IDS = [[5, 17, 3, 42]]
# A 4-bit round trip of these random weights is ~0.1 off; uninitialised scales are ~1 off, or not finite.
MAX_QUANTIZATION_ERROR = 0.5
# Computed logits of the same weights through another module layout (fused stock experts vs nn.Linear ones).
LOGITS_ATOL = 1e-5


def _load(path, model_type: str, bundle: bool) -> nn.Module:
    if not bundle:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with layerswap.use_bundle(f"{model_type}-quant"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _gptq_w4a16(model: nn.Module, path, **oneshot_options) -> None:
    dataset = Dataset.from_dict(
        {"input_ids": CALIBRATION_IDS, "attention_mask": [[1] * len(ids) for ids in CALIBRATION_IDS]}
    )
    recipe = GPTQModifier(
        targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
    )
    oneshot(
        model=model,
        processor=AutoTokenizer.from_pretrained(path),
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(CALIBRATION_IDS),
        max_seq_length=len(CALIBRATION_IDS[0]),
        **oneshot_options,
    )


def _expert_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every expert projection, named '<layer>.experts.<i>.<gate|up|down>' whatever the family calls them."""
    found = {}
    for name, experts in model.named_modules():
        if isinstance(experts, LinearExperts):
            names = experts.expert_names
            for index, expert in enumerate(experts):
                for role in ("gate", "up", "down"):
                    found[f"{name}.{index}.{role}"] = getattr(expert, getattr(names, role))
        elif isinstance(experts, LinearExperts2D):  # llm-compressor's own: gate_proj, up_proj, down_proj
            for index in range(experts.num_experts):
                for role in ("gate", "up", "down"):
                    found[f"{name}.{index}.{role}"] = getattr(experts[index], f"{role}_proj")
    return found


def _routed_token_counts(model: nn.Module) -> dict[str, int]:
    """How many calibration tokens each expert gets routed (a plain forward)."""
    counts, handles = {}, []
    for name, linear in _expert_linears(model).items():
        if name.endswith(".gate"):
            counts[name] = 0

            def count(module, args, output, name=name):
                counts[name] += args[0].shape[0]

            handles.append(linear.register_forward_hook(count))
    with torch.no_grad():
        model(torch.tensor(CALIBRATION_IDS))
    for handle in handles:
        handle.remove()
    return counts


def _quantization_errors(model: nn.Module, original: dict[str, torch.Tensor]) -> dict[str, float]:
    """|dequantized(weight, its 4-bit scales and zero points) - original weight| / |original weight|."""
    errors = {}
    for name, linear in _expert_linears(model).items():
        scale = linear.weight_scale.detach()
        zero_point = linear.weight_zero_point.detach().float()
        group = linear.weight.shape[1] // scale.shape[1]
        scale, zero_point = scale.repeat_interleave(group, 1), zero_point.repeat_interleave(group, 1)
        levels = torch.clamp(torch.round(linear.weight.detach() / scale) + zero_point, -8, 7)
        dequantized = (levels - zero_point) * scale
        errors[name] = ((dequantized - original[name]).norm() / original[name].norm()).item()
    return errors


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: linear.weight.detach().clone() for name, linear in _expert_linears(model).items()}


def _ruined(errors: dict[str, float]) -> list[str]:
    return sorted(
        name for name, error in errors.items() if not error < MAX_QUANTIZATION_ERROR
    )  # NaN is ruined


def _untouched_experts(model: nn.Module, original: dict[str, torch.Tensor]) -> set[str]:
    """Experts whose three weights GPTQ left bit-identical: it never ran on them (no calibration data), and their
    scales are whatever memory held (uninitialised)."""
    linears = _expert_linears(model)
    experts = {name.rsplit(".", 1)[0] for name in linears}
    return {
        expert
        for expert in experts
        if all(
            torch.equal(linears[f"{expert}.{role}"].weight, original[f"{expert}.{role}"])
            for role in ("gate", "up", "down")
        )
    }


def test_calibration_set_leaves_experts_without_routed_tokens(tiny_checkpoint):
    model_type, path = tiny_checkpoint
    counts = _routed_token_counts(_load(path, model_type, bundle=True))
    assert len(counts) == 2 * 8
    assert sum(count == 0 for count in counts.values()) >= 4, counts


def test_gptq_under_the_bundle_calibrates_every_expert(tiny_checkpoint):
    model_type, path = tiny_checkpoint
    model = _load(path, model_type, bundle=True)
    original = _weights(model)
    _gptq_w4a16(model, path)
    assert not _untouched_experts(model, original), "GPTQ never ran on these experts: no calibration data"
    errors = _quantization_errors(model, original)
    assert len(errors) == 2 * 8 * 3
    assert not _ruined(errors), f"expert tensors with unusable scales: {_ruined(errors)}"


def test_without_all_experts_calibration_some_experts_are_never_calibrated(tiny_checkpoint):
    # What the default protects against, in the real tool: the calibration set above is small enough to matter.
    # (Which experts: those the calibration forward routes nothing to, layer 1's after layer 0 is quantized.)
    model_type, path = tiny_checkpoint
    model = _load(path, model_type, bundle=True)
    original = _weights(model)
    _gptq_w4a16(model, path, moe_calibrate_all_experts=False)
    assert _untouched_experts(model, original)


# GPTQ's Hessians sum the same tokens in another grouping (routed, then unrouted, against llm-compressor's all at
# once), so float round-off flips an occasional 4-bit rounding: measured at most 0.18% of a weight's entries.
MAX_SHARE_OF_FLIPPED_ROUNDINGS = 0.01


def test_gptq_under_the_bundle_matches_llm_compressors_own_linearization(tiny_checkpoint):
    model_type, path = tiny_checkpoint
    bundled, stock = _load(path, model_type, bundle=True), _load(path, model_type, bundle=False)
    _gptq_w4a16(bundled, path)
    _gptq_w4a16(stock, path)  # llm-compressor linearises the stock fused experts itself
    ours, theirs = _expert_linears(bundled), _expert_linears(stock)
    assert len(ours) == 2 * 8 * 3
    assert set(ours) == set(theirs)
    different = [n for n in ours if not torch.equal(ours[n].weight_scale, theirs[n].weight_scale)]
    assert not different, f"scales differ from llm-compressor's own MoE path: {different}"
    flipped = {n: (ours[n].weight != theirs[n].weight).float().mean().item() for n in ours}
    assert max(flipped.values()) <= MAX_SHARE_OF_FLIPPED_ROUNDINGS, flipped


def test_compressed_save_reloads_with_and_without_the_bundle(tiny_checkpoint, tmp_path):
    model_type, path = tiny_checkpoint
    model = _load(path, model_type, bundle=True)
    _gptq_w4a16(model, path)
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = model(input_ids).logits
    model.save_pretrained(tmp_path, save_compressed=True)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        packed = [key for key in saved.keys() if ".experts." in key and key.endswith("weight_packed")]  # noqa: SIM118
    assert len(packed) == 2 * 8 * 3  # every expert projection, one by one, as stock per-expert checkpoints

    for bundle in (False, True):
        reloaded = _load(tmp_path, model_type, bundle=bundle)
        with torch.no_grad():
            logits = reloaded(input_ids).logits
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("all_experts", [True, False])
def test_llm_compressor_switch_is_where_layerswap_reads_it(all_experts):
    # The module and function all_experts.py reads; a later llm-compressor that moves them fails here first.
    from llmcompressor.modeling.moe import context

    from layerswap.swaps.quant.all_experts import (
        LLM_COMPRESSOR_SWITCH_MODULE,
        LLM_COMPRESSOR_SWITCH_READER,
        pipeline_requests_all_experts,
    )

    assert context.__name__ == LLM_COMPRESSOR_SWITCH_MODULE
    assert callable(getattr(context, LLM_COMPRESSOR_SWITCH_READER))
    if all_experts:
        with context.moe_calibration_context():
            assert pipeline_requests_all_experts()
    assert not pipeline_requests_all_experts()


@pytest.mark.parametrize("bundle", [True, False])
def test_what_an_unquantized_save_writes(tiny_checkpoint, bundle, tmp_path):
    # The bundle saves the stock checkpoint back bit for bit, for every family; llm-compressor's own linearization
    # does for qwen2_moe and qwen3_moe, but writes mixtral's experts under names stock transformers does not load
    # (its experts are then left uninitialised, with only the load report to say so). repack_moe undoes it.
    model_type, path = tiny_checkpoint
    model = _load(path, model_type, bundle=bundle)
    if not bundle:
        linearize_moe(model)
    assert len(_expert_linears(model)) == 2 * 8 * 3
    model.save_pretrained(tmp_path)
    saved, original = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
    identical = saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    if not bundle and model_type == "mixtral":
        assert not identical
        assert info["missing_keys"] and len(info["unexpected_keys"]) == 2 * 8 * 3
    else:
        assert identical
        assert not any(info.values()), info
    if not bundle:
        repack_moe(model)
        assert not _expert_linears(model)


PEAK_SPLITS = ("stock", "layerswap", "llm-compressor linearize_moe", "llm-compressor load_quantizable_moe")


def test_peak_memory_of_splitting_while_loading_and_after(tiny_checkpoint, tmp_path, measured):
    # docs/quantizers.md's peak-memory row: a larger random checkpoint (288 MiB of fp32 experts, saved per expert
    # as stock saves them), each load in a fresh process after a warm-up load of the tiny one
    # (integration/peak_memory.py says how it is measured).
    from llmcompressor.modeling.moe.conversion_mappings import has_linearize_load_mappings

    model_type, tiny = tiny_checkpoint
    path = save_larger_checkpoint(model_type, tmp_path)
    results = {}
    for split in PEAK_SPLITS:
        try:
            results[split] = measure(path, model_type, split, warmup=tiny)
        except RuntimeError as error:
            results[split] = {"error": str(error).splitlines()[-1]}
    record(measured, model_type, results)
    experts = results["stock"]["expert_mib"]
    # A stock load copies every expert out of the checkpoint into the fused tensors: its peak holds both.
    # Splitting while loading keeps the per-expert tensors as the checkpoint holds them (views of the mmapped file).
    assert results["layerswap"]["expert_linears"] == 3 * 32 * 3
    assert results["layerswap"]["peak_mib"] < results["stock"]["peak_mib"] - 0.8 * experts
    # Splitting after loading starts from the stock load's peak.
    assert results["llm-compressor linearize_moe"]["expert_linears"] == 3 * 32 * 3
    assert results["llm-compressor linearize_moe"]["peak_mib"] > results["stock"]["peak_mib"] - 0.1 * experts
    while_loading = results["llm-compressor load_quantizable_moe"]
    if has_linearize_load_mappings(model_type):  # qwen2_moe, qwen3_moe
        # Its while-loading path registers a transformers patch mapping; transformers 5.17's apply_patches then
        # walks dir() of every transformers module, importing each, and aria's image processor imports
        # torchvision. PyPI's torchvision is a CUDA build that cannot load beside CPU torch, so this venv has
        # none. (layerswap's bundles wrap apply_patches: they swap the classes bound in the transformers modules
        # already imported, and import nothing; layerswap/_hf/patching.py.)
        assert while_loading == {"error": "ModuleNotFoundError: No module named 'torchvision'"}
    else:  # mixtral: no load mappings, so it loads stock and runs linearize_moe
        assert while_loading["peak_mib"] > results["stock"]["peak_mib"] - 0.1 * experts
