"""calibrate_all_experts on every family with a '-quant' bundle: the outputs stay bit-identical, and each expert's
first projection sees every token its experts module got (at least once: a router may pick one expert twice for a
token, as deepseek_v4's hash routing does on a tiny vocabulary, and stock then runs it twice too)."""

import inspect

import pytest
import torch

import layerswap
from _support.families import MOE_FAMILIES
from _support.tiny_models import text_logits, tiny_input_ids, tiny_model
from layerswap import calibrate_all_experts
from layerswap.errors import BundleError
from layerswap.swaps.quant import LinearExperts


def _count_rows(model):
    """Rows each experts module got per call, and rows each of its real experts' first projection saw."""
    module_rows, expert_rows, handles = {}, {}, []
    for module in model.modules():
        if not isinstance(module, LinearExperts):
            continue

        def count_module(m, args, kwargs):
            hidden_states = args[0] if args else next(iter(kwargs.values()))
            module_rows[m] = module_rows.get(m, 0) + hidden_states.reshape(-1, m.hidden_dim).shape[0]

        # Dense experts (llama4's: forward(hidden_states) alone) see every token anyway.
        if len(inspect.signature(type(module).forward).parameters) >= 4:
            handles.append(module.register_forward_pre_hook(count_module, with_kwargs=True))
        for index in range(module.num_experts):
            first = getattr(module[index], module.expert_names.up)

            def count_expert(_m, args, _out, key=(module, index)):
                expert_rows[key] = expert_rows.get(key, 0) + args[0].shape[0]

            handles.append(first.register_forward_hook(count_expert))
    return module_rows, expert_rows, handles


@pytest.mark.parametrize("family", MOE_FAMILIES, ids=lambda f: f.model_type)
def test_every_expert_sees_every_token_and_outputs_are_unchanged(family):
    with layerswap.use_bundle(f"{family.model_type}-quant"):
        model = tiny_model(family.model_type)
    experts = [m for m in model.modules() if isinstance(m, LinearExperts)]
    refusal = next(
        (m._layerswap_calibration_refusal for m in experts if m._layerswap_calibration_refusal), None
    )
    if refusal is not None:  # jetmoe: a clear error, never a silent partial calibration
        with pytest.raises(BundleError, match="calibrate_all_experts cannot serve"):
            calibrate_all_experts(model).__enter__()
        return
    input_ids = tiny_input_ids()
    with torch.no_grad():
        expected = text_logits(model, input_ids)
        module_rows, expert_rows, handles = _count_rows(model)
        with calibrate_all_experts(model, chunk_size=5):
            calibrated = text_logits(model, input_ids)
        for handle in handles:
            handle.remove()
    assert torch.equal(calibrated, expected)
    for module, rows in module_rows.items():
        for index in range(module.num_experts):
            assert expert_rows.get((module, index), 0) >= rows, (type(module).__name__, index)
