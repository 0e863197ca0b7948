"""_hf.saving on one process: which saves are made all-or-nothing, and how the staged files move into place. The
sharded saves that fail on one rank run on two ranks in tests/test_distributed.py."""

from transformers import AutoModelForCausalLM
from transformers.modeling_utils import PreTrainedModel

import layerswap
from _support.tiny_models import tiny_model
from layerswap._hf import saving


def _files(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text(name)


def test_the_weights_files_of_an_earlier_save_that_the_new_one_does_not_write_are_stale(tmp_path):
    _files(
        tmp_path,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "model.fp16.safetensors",  # another variant's weights: not this save's
            "adapter_model.safetensors",
            "tokenizer.json",
            "config.json",
        ],
    )
    # A single file replaces the shards and their index (transformers' own save would keep the index).
    assert saving.stale_weights(tmp_path, ["config.json", "model.safetensors"]) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    # Shards replace a single file, which would otherwise load first.
    (tmp_path / "model.safetensors").write_text("old")
    written = [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    assert saving.stale_weights(tmp_path, written) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors",
    ]


def test_staged_files_move_into_the_target_replacing_its_weights_and_keeping_the_users_files(tmp_path):
    target, staging = tmp_path / "target", tmp_path / ".target.layerswap-saving-x"
    _files(target, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "README.md"])
    _files(staging, ["config.json", "generation_config.json", "model.safetensors"])
    saving.move_into_place(staging, target)
    assert sorted(p.name for p in target.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (target / "model.safetensors").read_text() == "model.safetensors"
    assert not list(staging.iterdir())


def test_a_save_in_one_process_writes_into_the_target_as_transformers_does(tmp_path):
    # Nothing is sharded: no staging folder, no collective; the save is transformers' own.
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "checkpoint")
    with layerswap.use_bundle("qwen3_moe-quant"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
        assert not saving.is_sharded_swapped(model)
        model.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "saved"]
    assert (tmp_path / "saved" / "model.safetensors").exists()


def test_the_all_or_nothing_save_is_installed_at_import_and_undone_exactly():
    ours = PreTrainedModel.__dict__["save_pretrained"]
    below = ours.__wrapped__
    saving.unwatch()
    try:
        assert PreTrainedModel.__dict__["save_pretrained"] is below
    finally:
        saving.watch()
    assert PreTrainedModel.__dict__["save_pretrained"].__wrapped__ is below
