"""Output recorders of swapped models: transformers' rewrite of `_can_record_outputs`, made safe for recorders whose
target is a tuple of classes."""

from __future__ import annotations

import torch

import layerswap
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model
from _support.transformers_support import needs_model_type


@needs_model_type("inkling2_loop")
def test_a_recorder_of_a_tuple_of_classes_survives_a_swapped_build(tmp_path):
    # inkling2_loop records hidden states off four decoder-layer classes at once; transformers' own rewrite reads
    # `target_class.__name__` and failed on the tuple, so no model with such a recorder could be swapped at all.
    from transformers.models.inkling2_loop import modeling_inkling2_loop

    recorder = modeling_inkling2_loop.Inkling2LoopTextModel._can_record_outputs["hidden_states"]
    targets = recorder.target_class
    assert isinstance(targets, tuple)
    stock = tiny_model("inkling2_loop")
    stock.save_pretrained(tmp_path)
    input_ids = tiny_input_ids()
    with torch.no_grad():
        expected = stock(input_ids, output_hidden_states=True).hidden_states
    with layerswap.use_bundle("inkling2_loop-quant"):
        model = auto_class("inkling2_loop").from_pretrained(tmp_path)
        assert recorder.target_class is targets  # kept, not set aside
        with torch.no_grad():
            hidden_states = model(input_ids, output_hidden_states=True).hidden_states
            torch.testing.assert_close(text_logits(model, input_ids), text_logits(stock, input_ids))
    assert len(hidden_states) == len(expected)
    for got, want in zip(hidden_states, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
