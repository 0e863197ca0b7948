"""Swapped modules on two CPU ranks (gloo): tensor parallelism (`tp_plan="auto"`) and expert parallelism
(`DistributedConfig(tp_size=2, ep_size=2)`) against one process, the sizes refused before loading, and saves that
fail on one rank.

One world of two spawned ranks runs every sharded load of this module (`_support.distributed`), another every
failing save; the reference logits come from the same checkpoints loaded in this process, without a bundle.
docs/distributed.md lists what these tests cover.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import layerswap
from _support.checkpoints import read_checkpoint
from _support.distributed import (
    WORLD_SIZE,
    Load,
    Save,
    distributed_available,
    load_on_ranks,
    run_on_ranks,
    saves_on_ranks,
)
from _support.tiny_models import auto_class, text_logits, tiny_input_ids, tiny_model

pytestmark = pytest.mark.skipif(not distributed_available(), reason="torch without gloo")

# qwen3_moe: per-expert names gate_proj/up_proj/down_proj, per-head q/k norms; mixtral: renamed ones (w1/w3/w2)
# under block_sparse_moe; llama: dense; olmoe: full-width q/k norms, so its stock plan gathers q, k and v. All with
# GQA (4 query, 2 key/value heads) and a stock tensor-parallel plan.
MODEL_TYPES = ("qwen3_moe", "mixtral", "llama", "olmoe")
# Per-expert checkpoints are what save_pretrained writes by default; fused ones (`experts.gate_up_proj [E, 2I, H]`)
# what save_original_format=False writes, and v5-native checkpoints hold.
LAYOUTS = ("per_expert", "fused")
# (model type, checkpoint layout, bundles): every tensor-parallel load the world runs; stock ones are the baseline.
TP_CASES = [
    *[(t, layout, ()) for t in MODEL_TYPES for layout in LAYOUTS],
    *[(t, layout, (f"{t}-quant",)) for t in ("qwen3_moe", "mixtral") for layout in LAYOUTS],
    *[(t, "per_expert", (f"{t}-fused_qkv",)) for t in MODEL_TYPES],
    ("qwen3_moe", "per_expert", ("qwen3_moe-quant", "qwen3_moe-fused_qkv")),
    *[(t, layout, (f"{t}-fast",)) for t in ("qwen3_moe", "mixtral", "olmoe") for layout in LAYOUTS],
]
# Expert parallelism as transformers runs it on two ranks: ep_size == tp_size, whole experts per rank (4 of 8), the
# attention tensor-parallel. At inference transformers' dispatch masks the routes to other ranks' experts and sums
# the ranks' outputs (all_reduce); "ep_all_to_all" sends each rank only its experts' tokens instead.
EP_CASES = [
    *[(t, "per_expert", bundles, "ep") for t in ("qwen3_moe", "mixtral") for bundles in ((), (f"{t}-fast",))],
    ("qwen3_moe", "fused", ("qwen3_moe-fast",), "ep"),
    *[(t, layout, (f"{t}-quant",), "ep") for t in ("qwen3_moe", "mixtral") for layout in LAYOUTS],
    ("qwen3_moe", "per_expert", ("qwen3_moe-quant",), "ep_all_to_all"),
]
CASES = [(*case, "tp") for case in TP_CASES] + EP_CASES
# from_pretrained's arguments for each mode.
EP = {"tp_size": 2, "ep_size": 2}
MODES = {
    "tp": (("tp_plan", "auto"),),
    "ep": (("distributed_config", EP),),
    "ep_all_to_all": (("distributed_config", {**EP, "ep_implementation": "all_to_all"}),),
}
# Sizes refused before any weight is loaded: 3 experts cannot be split into whole experts over 2 ranks; 6 query
# and 3 key/value heads cannot be split over 2 ranks by a fused attention.
REFUSED = [
    *[(t, bundle) for t in ("qwen3_moe", "mixtral") for bundle in (f"{t}-quant", f"{t}-fast")],
]
# The experts' intermediate size in the tiny configs.
EXPERT_INTERMEDIATE = {"qwen3_moe": 64, "mixtral": 128, "olmoe": 128, "llama": 0}
# fp32 logits of sums in another order: stock sharded against one process differs by about 2e-7.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _name(model_type, layout, bundles, mode):
    return "-".join(
        [model_type, layout, *(b.split("-", 1)[1] for b in bundles), *([mode] if mode != "tp" else [])]
    )


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The folder holding every sharded load's logits (or error) and save, the one-process logits, the stock
    models' state dicts and the checkpoints."""
    root = tmp_path_factory.mktemp("distributed")
    input_ids = tiny_input_ids()
    checkpoints, expected, originals = {}, {}, {}
    for model_type in MODEL_TYPES:
        model = tiny_model(model_type)
        originals[model_type] = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            expected[model_type] = text_logits(model, input_ids)
        for layout in LAYOUTS:
            path = root / f"{model_type}-{layout}"
            model.save_pretrained(path, save_original_format=layout == "per_expert")
            checkpoints[model_type, layout] = path
    # A checkpoint holding qkv_proj fused, as a save without the stock conversions writes it.
    with layerswap.use_bundle("llama-fused_qkv"):
        fused_attention = AutoModelForCausalLM.from_pretrained(checkpoints["llama", "per_expert"])
        fused_attention.save_pretrained(root / "llama-qkv_proj", save_original_format=False)
    loads = [
        Load(_name(*case), case[0], str(checkpoints[case[:2]]), case[2], MODES[case[3]], save=bool(case[2]))
        for case in CASES
    ]
    loads.append(
        Load("llama-qkv_proj-fused_qkv", "llama", str(root / "llama-qkv_proj"), ("llama-fused_qkv",))
    )
    for model_type in ("qwen3_moe", "mixtral"):
        tiny_model(model_type, num_experts=3, num_local_experts=3).save_pretrained(
            root / f"{model_type}-3-experts"
        )
    loads += [
        Load(f"refused-{bundle}", t, str(root / f"{t}-3-experts"), (bundle,), MODES["ep"])
        for t, bundle in REFUSED
    ]
    heads = tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    heads.save_pretrained(root / "llama-6-heads")
    loads.append(Load("refused-llama-fused_qkv", "llama", str(root / "llama-6-heads"), ("llama-fused_qkv",)))
    run_on_ranks(load_on_ranks, loads, input_ids, str(root), timeout_s=300)
    return root, expected, originals, checkpoints


def _logits(root, name):
    error = root / f"{name}.error"
    assert not error.exists(), error.read_text()
    return torch.load(root / f"{name}.pt")


@pytest.mark.parametrize("case", CASES, ids=[_name(*case) for case in CASES])
def test_sharded_logits_match_one_process(sharded, case):
    # Stock: the baseline. -quant: fused checkpoints used to be cut along the experts axis (by the rules of one
    # expert's 2D weight) before the split, and the load failed with CheckpointShapeError. -fused_qkv: each rank
    # holds its own q, k and v heads in qkv_proj. -fast under expert parallelism: its kernels used to refuse
    # experts marked _is_expert_parallel (KernelInputError).
    root, expected, _, _ = sharded
    torch.testing.assert_close(_logits(root, _name(*case)), expected[case[0]], **TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=[_name(*case) for case in CASES])
def test_the_swapped_modules_are_sharded(sharded, case):
    model_type, _, bundles, mode = case
    root = sharded[0]
    _logits(root, _name(*case))
    built = json.loads((root / f"{_name(*case)}.json").read_text())
    sharded_shapes = built["sharded"]
    assert bool(built["swapped"]) == bool(bundles), built["swapped"]
    layer = "model.layers.0"
    hidden, intermediate = 64, EXPERT_INTERMEDIATE[model_type]
    if mode.startswith("ep") and any(bundle.endswith("-quant") for bundle in bundles):
        # Whole experts per rank, each an nn.Linear MLP of its own (no DTensor): see the test below.
        assert not any(".experts." in name for name in sharded_shapes)
    elif any(bundle.endswith("-quant") for bundle in bundles):
        expert = f"{layer}.mlp.experts.0"
        gate, down = ("w1", "w2") if model_type == "mixtral" else ("gate_proj", "down_proj")
        # Each rank holds half of every expert's intermediate rows (gate) and columns (down).
        assert sharded_shapes[f"{expert}.{gate}.weight"] == [intermediate // 2, hidden]
        assert sharded_shapes[f"{expert}.{down}.weight"] == [hidden, intermediate // 2]
    if mode.startswith("ep") and (not bundles or any(bundle.endswith("-fast") for bundle in bundles)):
        # Whole experts per rank: 4 of the 8.
        assert sharded_shapes[f"{layer}.mlp.experts.gate_up_proj"] == [4, 2 * intermediate, hidden]
    elif any(bundle.endswith("-fast") for bundle in bundles):
        # The stock 3D experts, sharded by the stock plan: half of the gate rows and half of the up rows.
        assert sharded_shapes[f"{layer}.mlp.experts.gate_up_proj"] == [8, intermediate, hidden]
    if any(bundle.endswith(("-fused_qkv", "-fast")) for bundle in bundles):
        qkv = f"{layer}.self_attn.qkv_proj.weight"
        if model_type == "olmoe":  # stock gathers q, k and v: qkv_proj stays whole on every rank
            assert qkv not in sharded_shapes
        else:  # half of the 4 query and 2 key/value heads of 16
            assert sharded_shapes[qkv] == [(4 + 2 + 2) * 16 // 2, hidden]


EXPERT_PARALLEL = [case for case in CASES if case[3].startswith("ep")]


@pytest.mark.parametrize("case", EXPERT_PARALLEL, ids=[_name(*case) for case in EXPERT_PARALLEL])
def test_under_expert_parallelism_each_rank_holds_only_its_own_experts(sharded, case):
    # Stock and -fast: the stacked 3D experts split along the experts axis (DTensor shards). -quant: each rank keeps
    # the nn.Linear MLPs of its own block of experts; the others are weightless stand-ins, never loaded. Either way a
    # rank holds 1/world of the experts' parameters, and the ranks' experts are disjoint and complete.
    model_type, _, bundles, _ = case
    root, _, originals, _ = sharded
    _logits(root, _name(*case))
    held = json.loads((root / f"{_name(*case)}.json").read_text())["experts_per_rank"]
    total = sum(t.numel() for name, t in originals[model_type].items() if ".experts." in name)
    assert [rank["elements"] for rank in held] == [total // WORLD_SIZE] * WORLD_SIZE, (total, held)
    if any(bundle.endswith("-quant") for bundle in bundles):
        assert [rank["first_layer_experts"] for rank in held] == [[0, 1, 2, 3], [4, 5, 6, 7]]


SAVED = [case for case in CASES if case[2]]


@pytest.mark.parametrize("case", SAVED, ids=[_name(*case) for case in SAVED])
def test_a_save_from_the_sharded_model_reloads_in_stock_transformers_bitwise(sharded, case):
    model_type, layout, _, _ = case
    root, _, originals, checkpoints = sharded
    _logits(root, _name(*case))
    saved = root / f"{_name(*case)}-saved"
    if layout == "per_expert":
        # Same keys, same bytes as the checkpoint it came from (as the one-process save tests ask).
        ours, original = read_checkpoint(saved), read_checkpoint(checkpoints[model_type, layout])
        assert ours.keys() == original.keys()
        assert all(torch.equal(ours[k], original[k]) for k in ours)
    reloaded, info = auto_class(model_type).from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = reloaded.state_dict()
    assert state.keys() == originals[model_type].keys()
    assert all(torch.equal(state[k], originals[model_type][k]) for k in state)


def test_a_checkpoint_with_qkv_proj_fused_is_refused_under_tensor_parallelism(sharded):
    # Cut on read into contiguous row blocks, a [q|k|v] tensor would give the first rank only query rows.
    root = sharded[0]
    error = (root / "llama-qkv_proj-fused_qkv.error").read_text()
    assert error.startswith(
        "FusedQKVParallelismError: The checkpoint holds model.layers.0.self_attn.qkv_proj"
    )
    assert "over 2 ranks" in error and "save_pretrained(path)" in error


@pytest.mark.parametrize("model_type, bundle", REFUSED, ids=[bundle for _, bundle in REFUSED])
def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(sharded, model_type, bundle):
    # Stock transformers raises ValueError once sharding starts (-fast); -quant used to keep every expert everywhere.
    error = (sharded[0] / f"refused-{bundle}.error").read_text()
    assert error.startswith(
        "ExpertParallelismError: Expert parallelism over ep_size=2 ranks cannot split "
    ), error
    assert "num_experts=3" in error and "3 % 2 = 1" in error
    assert "Use an ep_size that divides 3 (1, 3), or tensor parallelism" in error


def test_a_tensor_parallel_size_that_splits_a_head_is_refused(sharded):
    error = (sharded[0] / "refused-llama-fused_qkv.error").read_text()
    assert error.startswith("FusedQKVParallelismError: "), error
    assert "6 query, 3 key and 3 value heads of 16" in error and "over 2 ranks" in error


# --- saves that fail on one rank ------------------------------------------------------------------------------

# (name, model type, bundles, mode, failure, failing rank, the target holds a checkpoint already)
FAILING_SAVES = [
    ("ep-convert", "qwen3_moe", ("qwen3_moe-quant",), "ep", "convert", 0, False),
    ("ep-write", "qwen3_moe", ("qwen3_moe-quant",), "ep", "write", 0, True),
    ("ep-gather", "mixtral", ("mixtral-quant",), "ep", "gather", 1, False),
    ("tp-convert", "qwen3_moe", ("qwen3_moe-quant",), "tp", "convert", 0, True),
    ("tp-fused_qkv-write", "llama", ("llama-fused_qkv",), "tp", "write", 0, False),
]
# Each injected failure's message (see _support.distributed._failing) and error type.
INJECTED = {
    "convert": "RuntimeError: injected: a conversion failed",
    "write": "OSError: injected: no space left on device",
    "gather": "RuntimeError: injected: gathering failed",
}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """The folder holding every save's target and each rank's error, the checkpoints, and a copy of each
    target's content before the save."""
    root = tmp_path_factory.mktemp("saves")
    checkpoints = {t: root / f"{t}-checkpoint" for t in ("qwen3_moe", "mixtral", "llama")}
    for model_type, path in checkpoints.items():
        tiny_model(model_type).save_pretrained(path)
    jobs, before = [], {}
    for name, model_type, bundles, mode, failure, rank, existing in FAILING_SAVES:
        target = root / name / "target"
        if existing:  # a checkpoint saved earlier, sharded, with a file of the user's
            tiny_model(model_type, seed=5).save_pretrained(target, max_shard_size="100KB")
            (target / "README.md").write_text("mine")
            before[name] = (sorted(p.name for p in target.iterdir()), read_checkpoint(target))
        # Small shards: the "write" failure comes after a first file was written.
        checkpoint = str(checkpoints[model_type])
        jobs.append(
            Save(name, model_type, checkpoint, bundles, MODES[mode], str(target), failure, rank, "100KB")
        )
    # A save that succeeds into a folder holding an earlier sharded checkpoint: a single file replaces its shards.
    target = root / "ep-over-shards" / "target"
    tiny_model("qwen3_moe", seed=5).save_pretrained(target, max_shard_size="100KB")
    (target / "README.md").write_text("mine")
    checkpoint = str(checkpoints["qwen3_moe"])
    jobs.append(
        Save("ep-over-shards", "qwen3_moe", checkpoint, ("qwen3_moe-quant",), MODES["ep"], str(target))
    )
    run_on_ranks(saves_on_ranks, jobs, str(root), timeout_s=240)
    return root, before, checkpoints


@pytest.mark.parametrize("case", FAILING_SAVES, ids=[case[0] for case in FAILING_SAVES])
def test_a_sharded_save_that_fails_on_one_rank_writes_nothing_and_fails_on_every_rank(saves, case):
    name, _, _, _, failure, failing_rank, existing = case
    root, before, _ = saves
    target = root / name / "target"
    if existing:  # the earlier checkpoint as it was, not half replaced
        names, tensors = before[name]
        assert sorted(p.name for p in target.iterdir()) == names
        ours = read_checkpoint(target)
        assert ours.keys() == tensors.keys()
        assert all(torch.equal(ours[k], tensors[k]) for k in ours)
        assert (target / "README.md").read_text() == "mine"
    else:
        assert not target.exists(), sorted(p.name for p in target.iterdir())
    # No staging folder left beside the target.
    assert sorted(p.name for p in target.parent.iterdir()) == (["target"] if existing else [])
    for rank in range(WORLD_SIZE):
        error = (root / f"{name}.rank{rank}.error").read_text()
        if rank == failing_rank:  # its own error, reaching the user as raised
            assert error.startswith(INJECTED[failure]), error
        else:
            assert error.startswith(f"ShardedSaveError: rank {failing_rank} failed "), error
            assert INJECTED[failure] in error
        assert f"nothing was written to {target}" in error


def test_a_sharded_save_over_an_earlier_sharded_checkpoint_replaces_its_weights(saves):
    root, _, checkpoints = saves
    target = root / "ep-over-shards" / "target"
    assert not list(root.glob("ep-over-shards.rank*.error"))
    # One file replaces the earlier save's shards and index; the user's file stays.
    assert sorted(p.name for p in target.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in target.parent.iterdir()) == ["target"]
    ours, original = read_checkpoint(target), read_checkpoint(checkpoints["qwen3_moe"])
    assert ours.keys() == original.keys()
    assert all(torch.equal(ours[k], original[k]) for k in ours)
