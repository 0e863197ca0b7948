"""record_routing / replay_routing / routing_from_vllm / calibrate_all_experts on tiny qwen2_moe models."""

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import layerswap
from _support.numerics import assert_computed_close
from _support.tiny_models import tiny_input_ids, tiny_model
from layerswap.calibration import calibrate_all_experts
from layerswap.errors import BundleError, RoutingMismatchError
from layerswap.routing import moe_routers, record_routing, replay_routing, routing_from_vllm
from layerswap.swaps.quant.modules import LinearExperts

MODEL_TYPE = "qwen2_moe"  # 2 MoE layers, 8 experts, top_k 2
TOP_K = 2
# Row 1 is left-padded by 3, as a tokenizer pads a batch for generation.
PADDED_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])


def _replayable(*bundles):
    with layerswap.use_bundle(f"{MODEL_TYPE}-replay", *bundles):
        return tiny_model(MODEL_TYPE)


def _generate(model, input_ids, attention_mask=None):
    # min_new_tokens: an early EOS would run fewer forwards than were recorded.
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
    )


def _perturb_routers(model):
    with torch.no_grad():
        for _, router in moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight))


def _assert_same_routing(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


# --- recording --------------------------------------------------------------------------------------------


def test_record_on_a_stock_model_one_tensor_per_moe_layer_in_layer_order():
    model = tiny_model(MODEL_TYPE)
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        output = model.model(input_ids, output_router_logits=True)
    assert recorded.layer_names == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert recorded.tokens_per_forward == [input_ids.numel()]
    # qwen2_moe picks the top-k of a softmax: the top-k of the logits, layer by layer.
    expected = [logits.topk(TOP_K, dim=-1).indices for logits in output.router_logits]
    _assert_same_routing(recorded.selected_experts, expected)
    assert all(t.dtype == torch.long and t.shape == (14, TOP_K) for t in recorded.selected_experts)


def test_several_forwards_are_concatenated_in_call_order_and_replay_in_order():
    model = _replayable()
    first, second = tiny_input_ids(2, 7), tiny_input_ids(1, 5, seed=2)
    with torch.no_grad():
        with record_routing(model) as recorded:
            expected = [model(first).logits, model(second).logits]
        assert recorded.tokens_per_forward == [14, 5]
        assert all(t.shape == (19, TOP_K) for t in recorded.selected_experts)
        with replay_routing(model, recorded):
            replayed = [model(first).logits, model(second).logits]
    assert all(torch.equal(r, e) for r, e in zip(replayed, expected, strict=True))


def test_a_forward_over_all_recorded_tokens_can_be_repeated():
    # Several epochs over one batch, or gradient checkpointing's recompute, replay the same routing each time.
    model = _replayable()
    input_ids = tiny_input_ids()
    with torch.no_grad():
        with record_routing(model) as recorded:
            expected = model(input_ids).logits
        with replay_routing(model, recorded):
            assert torch.equal(model(input_ids).logits, expected)
            assert torch.equal(model(input_ids).logits, expected)


def test_record_needs_an_moe_model():
    with pytest.raises(BundleError, match="no MoE router"), record_routing(tiny_model("llama")):
        pass


# --- replaying through generate and padded batches --------------------------------------------------------


@pytest.mark.parametrize("attention_mask", [None, PADDED_MASK], ids=["unpadded", "left-padded"])
def test_record_then_replay_through_generate(attention_mask):
    model = _replayable()
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        expected = _generate(model, input_ids, attention_mask)
    # The prompt (2 x 7 tokens), then one token per sequence per step; the last new token is never fed back.
    assert recorded.tokens_per_forward == [14, 2, 2, 2]
    with torch.no_grad(), replay_routing(model, recorded), record_routing(model) as replayed:
        assert torch.equal(_generate(model, input_ids, attention_mask), expected)
    _assert_same_routing(replayed.selected_experts, recorded.selected_experts)

    _perturb_routers(model)
    with torch.no_grad(), replay_routing(model, recorded), record_routing(model) as replayed:
        _generate(model, input_ids, attention_mask)
    _assert_same_routing(replayed.selected_experts, recorded.selected_experts)


def test_replay_through_a_padded_batch_matches_exactly():
    model = _replayable()
    input_ids = tiny_input_ids()
    with torch.no_grad():
        with record_routing(model) as recorded:
            expected = model(input_ids, attention_mask=PADDED_MASK).logits
        assert recorded.tokens_per_forward == [14]  # padding tokens are routed too
        with replay_routing(model, recorded):
            assert torch.equal(model(input_ids, attention_mask=PADDED_MASK).logits, expected)


def test_replay_composes_with_the_quant_bundle():
    model = _replayable(f"{MODEL_TYPE}-quant")
    assert any(isinstance(m, LinearExperts) for m in model.modules())
    input_ids = tiny_input_ids()
    with torch.no_grad():
        with record_routing(model) as recorded:
            expected = model(input_ids).logits
        with replay_routing(model, recorded):
            assert torch.equal(model(input_ids).logits, expected)
        _perturb_routers(model)
        with replay_routing(model, recorded), record_routing(model) as replayed:
            model(input_ids)
    _assert_same_routing(replayed.selected_experts, recorded.selected_experts)


# --- vLLM -------------------------------------------------------------------------------------------------


def _hand_built(seq_len, num_layers=3, top_k=TOP_K, offset=0):
    # value = token * 100 + layer * 10 + k: every entry says where it came from
    t, layer, k = np.meshgrid(np.arange(seq_len), np.arange(num_layers), np.arange(top_k), indexing="ij")
    return (offset + t * 100 + layer * 10 + k).astype(np.int32)


@pytest.mark.parametrize(
    "convert",
    [
        lambda a: a,
        torch.from_numpy,
        lambda a: torch.from_numpy(a).to(torch.int16),
        np.ndarray.tolist,
        lambda a: SimpleNamespace(routed_experts=a),
    ],
    ids=["numpy-int32", "torch-int32", "torch-int16", "nested-lists", "completion-output"],
)
def test_routing_from_vllm_maps_seq_layer_topk_to_per_layer_tensors(convert):
    array = _hand_built(5)
    routing = routing_from_vllm(convert(array))
    assert len(routing) == 3
    for layer, tensor in enumerate(routing):
        assert tensor.dtype == torch.long and tensor.shape == (5, TOP_K)
        assert tensor.tolist() == [[t * 100 + layer * 10 + k for k in range(TOP_K)] for t in range(5)]


def test_routing_from_vllm_places_sequences_into_a_padded_batch_row_major():
    # Right padding: sequence 0 has 3 real tokens, sequence 1 has 2; flat row = b * seq_len + s.
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    routing = routing_from_vllm([_hand_built(3), _hand_built(2, offset=5000)], attention_mask=mask)
    layer_1 = routing[1].tolist()
    assert layer_1[0:3] == [[t * 100 + 10 + k for k in range(TOP_K)] for t in range(3)]
    assert layer_1[4:6] == [[5000 + t * 100 + 10 + k for k in range(TOP_K)] for t in range(2)]
    assert [layer_1[i] for i in (3, 6, 7)] == [[0, 1]] * 3  # padding rows: experts 0..top_k-1
    # Without a mask, a list is a batch without padding: the sequences concatenated.
    assert routing_from_vllm([_hand_built(3), _hand_built(2)])[0].shape == (5, TOP_K)


@pytest.mark.parametrize("one_short", [False, True], ids=["full", "vllm-one-short"])
def test_vllm_routing_of_a_left_padded_batch_replays_the_real_tokens(one_short):
    model = _replayable()
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        expected = model(input_ids, attention_mask=PADDED_MASK).logits
    # What vLLM would return per sequence: its real tokens only, [seq_len, num_layers, top_k];
    # one short when the last generated token was never fed back.
    flat = torch.stack(recorded.selected_experts, dim=1)
    seq_len = PADDED_MASK.shape[1]
    per_sequence = []
    for row in range(2):
        real = flat[row * seq_len + PADDED_MASK[row].nonzero().squeeze(1)]
        per_sequence.append((real[:-1] if one_short else real).to(torch.int32).numpy())
    routing = routing_from_vllm(per_sequence, attention_mask=PADDED_MASK)
    with torch.no_grad(), replay_routing(model, routing):
        replayed = model(input_ids, attention_mask=PADDED_MASK).logits
    checked = PADDED_MASK.bool().clone()
    if one_short:
        checked[:, -1] = False  # the filled-in last token changes only its own logits
    # Padding's experts reach real tokens only through round-off: grouped_mm batches each expert's tokens, and
    # other padding rows change those batch sizes (measured 7e-8).
    torch.testing.assert_close(replayed[checked], expected[checked], atol=1e-6, rtol=1e-5)


def test_routing_from_vllm_errors_name_the_sequence_and_the_fix():
    with pytest.raises(BundleError, match="enable_return_routed_experts=True"):
        routing_from_vllm(SimpleNamespace(routed_experts=None))
    with pytest.raises(RoutingMismatchError, match=r"sequence 1 has 5 routed tokens.*expected 2, or 1"):
        routing_from_vllm(
            [_hand_built(3), _hand_built(5)], attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])
        )
    with pytest.raises(RoutingMismatchError, match=r"expected \(2, seq\)"):
        routing_from_vllm([_hand_built(3), _hand_built(3)], attention_mask=torch.ones(3, 3))
    with pytest.raises(RoutingMismatchError, match="sequence 1 has 2 layers"):
        routing_from_vllm([_hand_built(3), _hand_built(3, num_layers=2)])
    with pytest.raises(RoutingMismatchError, match=r"\[seq_len, num_layers, top_k\]"):
        routing_from_vllm(np.zeros((3, 2), dtype=np.int32))


# --- vLLM: what vLLM really returns ----------------------------------------------------------------------


def _per_sequence(selected, mask, *, one_short=False, start=0, moe_layers=None, num_layers=None):
    """What vLLM returns per sequence from a recording of a batch: the sequence's real tokens only, from row
    `start` (routed_experts_prompt_start), as [rows, num_hidden_layers, top_k] with dense layers zero-filled;
    one short when the last generated token was never fed back."""
    flat = torch.stack(selected, dim=1)
    if moe_layers is not None:
        full = torch.zeros(flat.shape[0], num_layers, flat.shape[2], dtype=flat.dtype)
        full[:, moe_layers] = flat
        flat = full
    seq_len = mask.shape[1]
    arrays = []
    for row in range(mask.shape[0]):
        real = flat[row * seq_len + mask[row].nonzero().squeeze(1)][start:]
        arrays.append((real[:-1] if one_short else real).to(torch.int32).numpy())
    return arrays


def _npy_base64(array, allow_pickle=False):
    # vLLM's OpenAI server: np.save to bytes, then base64
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_replay_rejects_rows_that_repeat_an_expert_and_names_vllms_compiled_mode(recorded_model):
    model, selected = recorded_model
    zero_filled = selected[1].clone()
    zero_filled[3:] = 0  # what vLLM 0.30.0 returned in its default compiled mode
    with pytest.raises(
        RoutingMismatchError,
        match=r"MoE layer 1 \(model\.layers\.1\.mlp\.gate\): token row 3 picks experts \[0, 0\].*"
        r"11 of 14 rows.*compiled mode.*enforce_eager=True",
    ):
        _replay(model, [selected[0], zero_filled])
    repeated = selected[0].clone()
    repeated[5] = repeated[5, 1]  # one row, not zeros
    with pytest.raises(RoutingMismatchError, match=r"MoE layer 0 .*token row 5 picks experts \[(\d+), \1\]"):
        _replay(model, [repeated, selected[1]])


def test_out_of_range_expert_ids_name_the_token_row(recorded_model):
    model, selected = recorded_model
    negative = selected[0].clone()
    negative[5, 1] = -3
    with pytest.raises(
        RoutingMismatchError,
        match=r"MoE layer 0 .*must lie in \[0, 8\), found -3\.\.\d; token row 5 has \[\d, -3\]",
    ):
        _replay(model, [negative, selected[1]])


def test_routing_from_vllm_rejects_zero_filled_rows_and_repeated_or_negative_ids():
    with pytest.raises(
        RoutingMismatchError, match=r"all zeros in every layer.*compiled mode.*enforce_eager=True"
    ):
        routing_from_vllm([np.zeros((5, 3, TOP_K), dtype=np.int32)] * 2)
    repeated = _hand_built(5)
    repeated[2, 1] = 7
    with pytest.raises(
        RoutingMismatchError, match=r"sequence 1, token row 2, layer 1: experts \[7, 7\].*enforce_eager=True"
    ):
        routing_from_vllm([_hand_built(3), repeated])
    negative = _hand_built(5)
    negative[4, 2, 0] = -1
    with pytest.raises(RoutingMismatchError, match=r"sequence 0, token row 4, layer 2: experts \[-1, 421\]"):
        routing_from_vllm(negative)
    # A layer all zeros in every row is a dense layer's zero fill: kept, for replay_routing to ignore.
    dense = _hand_built(5)
    dense[:, 0] = 0
    assert torch.equal(routing_from_vllm(dense)[0], torch.zeros(5, TOP_K, dtype=torch.long))


DENSE_LAYER_MODELS = [
    ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0]}),
    ("deepseek_v3", {"num_hidden_layers": 3, "first_k_dense_replace": 1}),
]


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    DENSE_LAYER_MODELS,
    ids=["qwen2_moe-mlp_only_layers", "deepseek_v3-first_k_dense"],
)
def test_vllm_routing_with_an_entry_per_decoder_layer_replays_a_model_with_dense_layers(
    model_type, overrides
):
    with layerswap.use_bundle(f"{model_type}-replay"):
        model = tiny_model(model_type, **overrides)
    assert [name for name, _ in moe_routers(model)] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        expected = model(input_ids).logits
    # vLLM: one entry per decoder layer, the dense layer 0 zero-filled.
    arrays = _per_sequence(recorded.selected_experts, torch.ones(2, 7), moe_layers=[1, 2], num_layers=3)
    routing = routing_from_vllm(arrays)
    assert len(routing) == 3
    with torch.no_grad(), replay_routing(model, routing):
        assert_computed_close(model(input_ids).logits, expected)
    _perturb_routers(model)
    for layers in (routing, routing[1:]):  # every decoder layer, or the MoE layers only
        with torch.no_grad(), replay_routing(model, layers), record_routing(model) as replayed:
            model(input_ids)
        _assert_same_routing(replayed.selected_experts, recorded.selected_experts)
    with pytest.raises(
        RoutingMismatchError,
        match=r"has 4 layers, but the model has 2 MoE layers \(expected 2 .* or 3, one per decoder layer "
        r"as vLLM's routed_experts has: MoE at decoder layers \[1, 2\]",
    ):
        _replay(model, [*routing, routing[0]])


def test_routing_from_vllm_decodes_the_openai_servers_base64_npy():
    array = _hand_built(5).astype(np.uint16)  # the server sends uint8 / uint16
    offline = routing_from_vllm(array)
    served = _npy_base64(array)
    for response in (
        served,
        served.encode(),
        {"routed_experts": served},
        SimpleNamespace(routed_experts=served),
    ):
        _assert_same_routing(routing_from_vllm(response), offline)
    _assert_same_routing(routing_from_vllm([served, served]), routing_from_vllm([array, array]))
    with pytest.raises(
        RoutingMismatchError, match=r"sequence 0: routed_experts is a string.*base64-encoded \.npy"
    ):
        routing_from_vllm("not base64")
    with pytest.raises(RoutingMismatchError, match=r"sequence 1: .*base64-encoded \.npy.*pickle"):
        routing_from_vllm([served, _npy_base64(np.array([{"a": 1}], dtype=object), allow_pickle=True)])


def test_routing_from_vllm_prompt_start_replays_from_the_offset_and_routes_the_prompt_head_live():
    model = _replayable()
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        model(input_ids, attention_mask=PADDED_MASK)
    start = 2  # SamplingParams(routed_experts_prompt_start=2): vLLM's rows start at prompt token 2
    arrays = _per_sequence(recorded.selected_experts, PADDED_MASK, one_short=True, start=start)
    routing = routing_from_vllm(arrays, attention_mask=PADDED_MASK, prompt_start=start)
    _perturb_routers(model)
    with torch.no_grad(), record_routing(model) as live:
        model(input_ids, attention_mask=PADDED_MASK)
    with torch.no_grad(), replay_routing(model, routing), record_routing(model) as replayed:
        model(input_ids, attention_mask=PADDED_MASK)
    head, replayed_rows = [], []
    for row in range(2):
        positions = row * PADDED_MASK.shape[1] + PADDED_MASK[row].nonzero().squeeze(1)
        head.append(positions[:start])
        replayed_rows.append(positions[start:-1])
    head, replayed_rows = torch.cat(head), torch.cat(replayed_rows)
    assert any(
        not torch.equal(free[head], rec[head])
        for free, rec in zip(live.selected_experts, recorded.selected_experts, strict=True)
    ), "the perturbation should change the live choice, or this test proves nothing"
    for ours, free, rec in zip(
        replayed.selected_experts, live.selected_experts, recorded.selected_experts, strict=True
    ):
        assert torch.equal(ours[head], free[head])  # the skipped prompt rows: the live router's choice
        assert torch.equal(ours[replayed_rows], rec[replayed_rows])  # the rest: vLLM's
    # Without a mask: the skipped rows lead each sequence, as rows of -1 (route live).
    unpadded = routing_from_vllm([_hand_built(3), _hand_built(2)], prompt_start=[1, 2])
    assert unpadded[0].tolist()[:1] == [[-1, -1]] and unpadded[0].tolist()[4:6] == [[-1, -1]] * 2
    assert unpadded[0].shape == (8, TOP_K)


def _request_output(routed_experts, prompt_tokens, output_tokens, num_outputs=1):
    # vLLM's RequestOutput: prompt_token_ids, and one CompletionOutput per sample (n) in .outputs
    completion = SimpleNamespace(routed_experts=routed_experts, token_ids=list(range(output_tokens)))
    return SimpleNamespace(prompt_token_ids=list(range(prompt_tokens)), outputs=[completion] * num_outputs)


def test_routing_from_vllm_rejects_bad_prompt_starts():
    arrays = [_hand_built(4), _hand_built(3)]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    for bad in (-1, 1.5, True, [1], [1, -2]):
        with pytest.raises(RoutingMismatchError, match="prompt_start"):
            routing_from_vllm(arrays, attention_mask=mask, prompt_start=bad)
    with pytest.raises(
        RoutingMismatchError,
        match=r"sequence 1 has 3 routed tokens from prompt_start 3, but row 1 of attention_mask has 4 real",
    ):
        routing_from_vllm(arrays, attention_mask=mask, prompt_start=[1, 3])
    # A RequestOutput knows its prompt: the offset must lie inside it, as vLLM requires.
    with pytest.raises(RoutingMismatchError, match=r"prompt_start 3 .* prompt has 3 tokens"):
        routing_from_vllm(_request_output(_hand_built(2), 3, 3), prompt_start=3)
    # 3 prompt + 3 output tokens, rows from prompt token 1: vLLM returns 3 + 3 - 1 - 1 = 4 rows.
    assert routing_from_vllm(_request_output(_hand_built(4), 3, 3), prompt_start=1)[0].shape == (5, TOP_K)
    with pytest.raises(
        RoutingMismatchError,
        match=r"sequence 0 has 4 routed tokens, but its request has 3 prompt \+ 3 output.*"
        r"expected 5.*routed_experts_prompt_start.*prompt_start=",
    ):
        routing_from_vllm(_request_output(_hand_built(4), 3, 3))


def test_a_list_of_vllm_arrays_one_row_short_without_a_mask_names_the_fix():
    model = _replayable()
    input_ids = tiny_input_ids()
    with torch.no_grad(), record_routing(model) as recorded:
        expected = model(input_ids).logits
    unpadded = torch.ones(2, 7, dtype=torch.long)
    arrays = _per_sequence(recorded.selected_experts, unpadded, one_short=True)
    with pytest.raises(
        RoutingMismatchError,
        match=r"each of the 2 vLLM sequences is one row short.*last generated token.*attention_mask=",
    ):
        _replay(model, routing_from_vllm(arrays), input_ids)
    with torch.no_grad(), replay_routing(model, routing_from_vllm(arrays, attention_mask=unpadded)):
        replayed = model(input_ids).logits
    assert_computed_close(
        replayed[:, :-1], expected[:, :-1]
    )  # the filled-in last row changes only its logits


def test_routing_from_vllm_takes_a_request_output_with_one_completion():
    request = _request_output(_hand_built(5), 3, 3)
    completion = request.outputs[0]
    _assert_same_routing(routing_from_vllm(request), routing_from_vllm(completion))
    _assert_same_routing(routing_from_vllm([request, request]), routing_from_vllm([completion, completion]))
    with pytest.raises(
        BundleError, match=r"sequence 0 is a RequestOutput with 2 completions.*\.outputs\[0\]"
    ):
        routing_from_vllm(_request_output(_hand_built(5), 3, 3, num_outputs=2))
    with pytest.raises(BundleError, match=r"sequence 1 is a RequestOutput with 0 completions"):
        routing_from_vllm([request, _request_output(_hand_built(5), 3, 3, num_outputs=0)])


# --- mismatches -------------------------------------------------------------------------------------------


@pytest.fixture
def recorded_model():
    model = _replayable()
    with torch.no_grad(), record_routing(model) as recorded:
        model(tiny_input_ids())
    return model, recorded.selected_experts


def _replay(model, routing, *batches, **options):
    with torch.no_grad(), replay_routing(model, routing, **options):
        for input_ids in batches:
            model(input_ids)


def test_wrong_number_of_layers(recorded_model):
    model, selected = recorded_model
    with pytest.raises(
        RoutingMismatchError, match=r"has 1 layers, but the model has 2 MoE layers \(expected 2"
    ):
        _replay(model, selected[:1])


def test_wrong_top_k(recorded_model):
    model, selected = recorded_model
    wider = [torch.cat([t, t[:, :1]], dim=1) for t in selected]
    with pytest.raises(
        RoutingMismatchError, match=r"top_k 3, but the router picks top_k 2.*\[num_tokens, 2\]"
    ):
        _replay(model, wider)


def test_wrong_number_of_tokens(recorded_model):
    model, selected = recorded_model
    # Raised in the forward itself, before a loss could be computed on misaligned routing.
    with pytest.raises(RoutingMismatchError, match=r"layer 0 .* routes 10 tokens .* has 14 tokens for it"):
        _replay(model, selected, tiny_input_ids(2, 5))
    with pytest.raises(
        RoutingMismatchError, match=r"layer 1 .* has 13 tokens, but layer 0 has 14.*expected 14"
    ):
        _replay(model, [selected[0], selected[1][:13]])


def test_one_token_short_points_at_routing_from_vllm(recorded_model):
    model, selected = recorded_model
    with pytest.raises(RoutingMismatchError, match="attention_mask to routing_from_vllm"):
        _replay(model, [t[:13] for t in selected], tiny_input_ids())


def test_leaving_with_forwards_unreplayed():
    # e.g. generate stopping at EOS earlier than it did while recording
    model = _replayable()
    with torch.no_grad(), record_routing(model) as recorded:
        model(tiny_input_ids(2, 7))
        model(tiny_input_ids(1, 5))
    with pytest.raises(RoutingMismatchError, match=r"replayed 1 of the 2 recorded forwards.*\[14, 5\]"):
        _replay(model, recorded, tiny_input_ids(2, 7))


def test_tokens_per_forward_splits_the_routing(recorded_model):
    model, selected = recorded_model
    with pytest.raises(RoutingMismatchError, match=r"tokens_per_forward \[10, 2\] sums to 12.*summing to 14"):
        _replay(model, selected, tokens_per_forward=[10, 2])
    _replay(model, selected, tiny_input_ids(1, 7), tiny_input_ids(1, 7, seed=2), tokens_per_forward=[7, 7])


def test_expert_ids_out_of_range(recorded_model):
    model, selected = recorded_model
    too_high = selected[1].clone()
    too_high[0, 0] = 8
    with pytest.raises(RoutingMismatchError, match=r"must lie in \[0, 8\), found 0..8"):
        _replay(model, [selected[0], too_high])


def test_replay_needs_the_replay_bundle():
    model = tiny_model(MODEL_TYPE)
    with torch.no_grad(), record_routing(model) as recorded:
        model(tiny_input_ids())
    with pytest.raises(BundleError, match=f"'{MODEL_TYPE}-replay' bundle enabled"):
        _replay(model, recorded)


def test_replay_blocks_do_not_nest_and_errors_inside_clean_up(recorded_model):
    model, selected = recorded_model
    with replay_routing(model, selected), pytest.raises(BundleError, match="do not nest"):
        _replay(model, selected)
    with pytest.raises(ValueError, match="inside"), replay_routing(model, selected):
        raise ValueError("inside")
    assert all(router._layerswap_replay is None for _, router in moe_routers(model))


# --- calibrate_all_experts --------------------------------------------------------------------------------


def _count_expert_inputs(model):
    """Every row each expert linear sees, and the hidden states each experts module is called with."""
    seen, layer_inputs, handles = {}, {}, []
    for name, module in model.named_modules():
        if isinstance(module, LinearExperts):
            layer_inputs[name] = []
            handles.append(
                module.register_forward_pre_hook(lambda m, a, rows=layer_inputs[name]: rows.append(a[0]))
            )
        elif isinstance(module, nn.Linear) and ".experts." in name:
            seen[name] = []
            handles.append(module.register_forward_hook(lambda m, a, o, rows=seen[name]: rows.append(a[0])))
    return seen, layer_inputs, handles


def _rows(tensors):
    return sorted(map(tuple, torch.cat(tensors).tolist()))


def test_calibrate_all_experts_feeds_every_token_to_every_expert_with_unchanged_outputs():
    with layerswap.use_bundle(f"{MODEL_TYPE}-quant"):
        model = tiny_model(MODEL_TYPE)
    input_ids = tiny_input_ids()
    with torch.no_grad():
        expected = model(input_ids).logits
        seen, layer_inputs, handles = _count_expert_inputs(model)
        with calibrate_all_experts(model, chunk_size=3):  # 3 < 14 tokens: several chunks per expert
            calibrated = model(input_ids).logits
        for handle in handles:
            handle.remove()
    assert torch.equal(calibrated, expected)
    assert len(seen) == 2 * 8 * 3
    assert all(sum(rows.shape[0] for rows in calls) == input_ids.numel() for calls in seen.values())
    for name, calls in seen.items():
        if name.endswith("gate_proj"):  # each token exactly once, as the experts module got it
            layer = name.split(".experts.")[0] + ".experts"
            assert _rows(calls) == _rows(layer_inputs[layer])
    assert all(not m._forward_hooks for m in model.modules() if isinstance(m, LinearExperts))


def test_calibrate_all_experts_needs_linear_experts():
    stock = tiny_model(MODEL_TYPE)
    with pytest.raises(BundleError, match=f"stock Qwen2MoeExperts.*'{MODEL_TYPE}-quant' bundle"):
        calibrate_all_experts(stock).__enter__()
    with pytest.raises(BundleError, match="no MoE experts"):
        calibrate_all_experts(tiny_model("llama")).__enter__()
    with pytest.raises(BundleError, match="chunk_size must be a positive int"):
        calibrate_all_experts(stock, chunk_size=0).__enter__()
