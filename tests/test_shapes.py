"""model_shapes.json ships inside the package; LAYERSWAP_MODEL_SHAPES replaces it."""

import json
from pathlib import Path

import pytest

import layerswap
from layerswap import shapes
from layerswap.shapes import load_model_shapes, model_shape, model_shapes_path, resolve_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_table_is_package_data_with_a_source_for_every_entry(monkeypatch):
    monkeypatch.delenv(shapes.SHAPES_ENV, raising=False)
    path = model_shapes_path()
    assert path.is_file()
    assert Path(layerswap.__file__).parent in path.parents
    raw = json.loads(path.read_text())
    for name, entry in raw.items():
        if name.startswith("_"):
            continue
        assert entry["_source"]["url"].startswith(f"https://huggingface.co/{name}/"), name
        assert entry["model_type"] and entry["hidden_size"] > 0, name
    assert "Qwen/Qwen3-30B-A3B" in load_model_shapes()
    assert not any(key.startswith("_") for key in model_shape("Qwen/Qwen3-30B-A3B"))


def test_nothing_in_the_repo_reads_outside_it():
    # A user's clone has nothing beside it (the folder this names exists only on the machine it was written on).
    outside = "/".join(("..", "shared"))
    sources = [
        path
        for folder in ("src", "tests", "benchmarks", ".ci")
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in {".py", ".sh", ".json", ""} and "__pycache__" not in path.parts
    ]
    offenders = [str(p.relative_to(ROOT)) for p in sources if outside in p.read_text(errors="ignore")]
    assert not offenders


def test_the_environment_variable_replaces_the_table(tmp_path, monkeypatch):
    table = tmp_path / "shapes.json"
    table.write_text(json.dumps({"_about": "x", "me/tiny": {"model_type": "qwen3_moe", "hidden_size": 64}}))
    monkeypatch.setenv(shapes.SHAPES_ENV, str(table))
    assert load_model_shapes() == {"me/tiny": {"model_type": "qwen3_moe", "hidden_size": 64}}
    assert resolve_config("me/tiny").hidden_size == 64
    with pytest.raises(layerswap.BundleError, match="not in"):
        model_shape("Qwen/Qwen3-30B-A3B")


@pytest.mark.parametrize(("content", "message"), [(None, "No model_shapes.json"), ("{", "not valid JSON")])
def test_a_bad_override_is_a_clear_error(tmp_path, monkeypatch, content, message):
    table = tmp_path / "shapes.json"
    if content is not None:
        table.write_text(content)
    monkeypatch.setenv(shapes.SHAPES_ENV, str(table))
    with pytest.raises(layerswap.BundleError, match=message):
        load_model_shapes()
