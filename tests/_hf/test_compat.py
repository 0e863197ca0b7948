"""The supported transformers range: the import check, bundles that need a newer release, and the declared range.

No old release needs installing: the checks run against a table with a fake internal added, or one taken away
(`.ci/floor` runs the tests on the oldest supported release itself)."""

import re
import sys
import types
from pathlib import Path

import pytest
from packaging.version import Version
from transformers import conversion_mapping

import layerswap
from layerswap import cli
from layerswap._hf import compat as _compat
from layerswap._hf import patching
from layerswap.errors import UnsupportedTransformersError

ROOT = Path(__file__).resolve().parents[2]


def _fake(needed_for=None, since="5.99"):
    return _compat.Internal(
        "transformers.monkey_patching", "no_such_internal", since, "does something new", needed_for=needed_for
    )


def test_every_internal_every_bundle_needs_is_installed_and_no_newer_than_the_floor():
    # A required internal newer than the floor would make the declared floor false.
    for internal in _compat.INTERNALS:
        assert _compat.lacks(internal) is None or internal.needed_for or internal.fallback, internal.name
        if internal.needed_for is None and internal.fallback is None:
            assert Version(internal.since) <= Version(_compat.FLOOR), internal.name


def test_a_missing_internal_is_an_import_error_naming_the_floor_and_the_internal(monkeypatch):
    monkeypatch.setattr(_compat, "INTERNALS", (*_compat.INTERNALS, _fake()))
    with pytest.raises(ImportError) as raised:
        _compat.check_transformers()
    message = str(raised.value)
    assert "layerswap needs transformers >= 5.15" in message
    assert "transformers.monkey_patching.no_such_internal (added in transformers 5.99" in message
    assert "pip install 'transformers>=5.15,<5.25'" in message


def test_a_release_below_the_floor_is_an_import_error_naming_what_it_lacks(monkeypatch):
    # As transformers 5.10.4 is: no USER_REGISTERED_MAPPINGS (added in 5.13).
    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", "5.10.4")
    monkeypatch.delattr(conversion_mapping, "USER_REGISTERED_MAPPINGS")
    with pytest.raises(ImportError) as raised:
        _compat.check_transformers()
    message = str(raised.value)
    assert "needs transformers >= 5.15" in message and "transformers 5.10.4 is older than 5.15.0" in message
    assert "transformers.conversion_mapping.USER_REGISTERED_MAPPINGS (added in transformers 5.13" in message


def test_a_release_below_the_floor_fails_even_with_every_required_internal(monkeypatch):
    monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", "5.14.1")
    with pytest.raises(
        ImportError, match=r"transformers 5\.14\.1 is older than 5\.15\.0, the oldest release CI"
    ):
        _compat.check_transformers()


def test_supported_releases_import():
    for version in (_compat.FLOOR, _compat.NEWEST_TESTED):
        assert _compat.unsupported_message(version, []) is None


class _Holder:
    def plain(self):
        pass

    @staticmethod
    def static():
        pass


class _Derived(_Holder):
    pass


def test_an_internal_that_changed_kind_or_owner_counts_as_missing():
    # layerswap unwraps staticmethods through __func__ and restores wrapped attributes in the class's own __dict__.
    def internal(attribute, **kind):
        return _compat.Internal(__name__, attribute, "5.0", "a test", **kind)

    assert _compat.lacks(internal("_Holder.static", static=True)) is None
    assert _compat.lacks(internal("_Holder.plain", static=True)) == "not a staticmethod (function)"
    assert _compat.lacks(internal("_Holder.plain", own=True)) is None
    assert _compat.lacks(internal("_Derived.plain", own=True)) == "not defined on _Derived itself"
    assert _compat.lacks(internal("_Holder.gone")) == "absent"
    assert _compat.lacks(_compat.Internal("transformers.no_such_module", "x", "5.0", "a test")) == (
        "no module transformers.no_such_module"
    )


def test_an_internal_only_some_bundles_need_refuses_just_those_at_enable(monkeypatch):
    monkeypatch.setattr(_compat, "INTERNALS", (_fake(needed_for="fused_qkv"),))
    assert _compat.missing_for("quant") == []
    assert _compat.missing_for("fused_qkv") == [
        "transformers.monkey_patching.no_such_internal (added in transformers 5.99; layerswap does something new)"
    ]
    for name in ("qwen2_moe-fused_qkv", "qwen2_moe-fast"):  # '-fast' fuses qwen2_moe's attention too
        with pytest.raises(UnsupportedTransformersError) as raised:
            layerswap.enable_bundle(name)
        message = str(raised.value)
        assert f"Bundle {name!r} needs transformers >= 5.99" in message
        assert "lacks transformers.monkey_patching.no_such_internal" in message
        assert "pip install 'transformers>=5.99,<5.25'" in message
    # deepseek_v2's '-fast' bundle fuses no attention; '-quant' needs nothing new.
    assert _compat.bundle_requirement(layerswap.get_bundle("deepseek_v2-fast")) is None
    with layerswap.use_bundle("qwen2_moe-quant"):
        pass


@pytest.mark.parametrize(
    "name",
    [b.name for b in layerswap.list_bundles() if _compat.bundle_requirement(b) is not None]
    or [
        pytest.param(None, marks=pytest.mark.skip(reason="the installed transformers supports every bundle"))
    ],
)
def test_each_bundle_the_installed_transformers_is_too_old_for_refuses_at_enable(name):
    requirement = _compat.bundle_requirement(layerswap.get_bundle(name))
    with pytest.raises(
        UnsupportedTransformersError, match=f"Bundle {name!r} needs {re.escape(requirement)}: "
    ):
        layerswap.enable_bundle(name)


def test_layerswap_list_marks_the_bundles_the_installed_transformers_is_too_old_for(monkeypatch, capsys):
    monkeypatch.setattr(
        _compat, "INTERNALS", (*_compat.INTERNALS, _fake(needed_for="fused_qkv", since="5.98"))
    )
    assert cli.main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert lines["qwen2_moe-fused_qkv"].endswith("[needs transformers >= 5.98]")
    assert lines["qwen2_moe-fast"].endswith("[needs transformers >= 5.98]")
    assert "[needs" not in lines["qwen2_moe-quant"] and "[needs" not in lines["deepseek_v2-fast"]
    assert cli.main(["list", "--markdown"]) == 0
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| `qwen2_moe-fused_qkv`"))
    assert row.endswith("Needs transformers >= 5.98. |")


def test_the_declared_range_is_the_one_ci_tests():
    tomllib = pytest.importorskip("tomllib")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{_compat.SUPPORTED}" in dependencies
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", _compat.SUPPORTED).groups()
    assert Version(low).release == Version(_compat.FLOOR).release[:2]
    assert Version(_compat.NEWEST_TESTED) < Version(high)
    pins = {}
    for name in ("floor.txt", "newest.txt"):
        lines = (ROOT / "constraints" / name).read_text().splitlines()
        pins[name] = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins["floor.txt"]["transformers"] == _compat.FLOOR
    assert pins["newest.txt"]["transformers"] == _compat.NEWEST_TESTED


def test_the_class_swap_never_imports_a_lazy_module(monkeypatch):
    # transformers 5.17 aliases each image processor module to one whose __getattr__ imports the real module
    # (torchvision with it); reading the alias's __all__ through getattr raised ModuleNotFoundError mid-build.
    def _import_on_access(name):
        raise ModuleNotFoundError("No module named 'torchvision'")

    alias = types.ModuleType("transformers.models.fake.image_processing_fake_fast")
    alias.__getattr__ = _import_on_access
    monkeypatch.setitem(sys.modules, alias.__name__, alias)
    with layerswap.use_bundle("qwen2_moe-quant"), patching._swap_classes():
        pass
