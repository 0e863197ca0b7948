"""The family table against the installed transformers: every row exists, no group-A family is left out."""

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import transformers.models
from transformers.integrations.moe import use_experts_implementation  # noqa: F401  (the decorator we look for)

from _support.transformers_support import row_missing
from layerswap._hf.discovery import discover
from layerswap.catalog import CATALOG
from layerswap.families import ALREADY_LINEAR, DERIVED, FAMILIES, UNCOVERED, _primary


def _group_a_classes():
    found = {}
    for info in pkgutil.iter_modules(transformers.models.__path__):
        path = f"{transformers.models.__path__[0]}/{info.name}/modeling_{info.name}.py"
        try:
            source = Path(path).read_text()
        except OSError:
            continue
        lines = source.splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.strip() == "@use_experts_implementation" and lines[i + 1].startswith("class "):
                found.setdefault(info.name, []).append(lines[i + 1].split()[1].split("(")[0])
    return found


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model_type)
def test_every_row_names_classes_the_installed_transformers_has(family):
    newer = row_missing(family)  # None on the newest release CI tests: there a missing class fails
    if newer is not None:
        pytest.skip(newer)
    module = importlib.import_module(family.modeling_module)
    for name in (family.experts, family.router, family.attention):
        if name is not None:
            assert inspect.isclass(getattr(module, name, None)), f"{family.modeling_module} has no {name}"


def test_every_moe_family_of_the_installed_transformers_is_served_or_listed_with_a_reason():
    # An independent scan (modeling files with a plain @use_experts_implementation class) against the families
    # layerswap serves and the ones it lists as uncovered, with their reasons.
    served = {f.model_type for f in FAMILIES if f.experts}
    served_modules = {f.modeling_module for f in FAMILIES if f.experts}
    for name in _group_a_classes():
        module = f"transformers.models.{name}.modeling_{name}"
        found = next(f for f in discover() if f.module_name == name)
        assert module in served_modules or _primary(found) in UNCOVERED, f"{name}: neither served nor listed"
    listed = {_primary(found) for found in discover()} - served - set(ALREADY_LINEAR)
    assert listed == set(UNCOVERED), "UNCOVERED names a family layerswap serves, or misses one"
    assert set(ALREADY_LINEAR) <= {_primary(found) for found in discover()} - served - set(UNCOVERED)
    assert all(len(reason) > 20 for reason in UNCOVERED.values())
    assert len(served) >= 40
    assert {
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "mixtral",
        "minimax",
        "olmoe",
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe",
        "dots1",
        "ernie4_5_moe",
        "hunyuan_v1_moe",
        "granitemoe",
        "phimoe",
        "jamba",
        "exaone_moe",
    } <= served


def test_every_moe_row_has_a_quant_bundle():
    for family in FAMILIES:
        if family.experts:
            bundle = CATALOG[f"{family.model_type}-quant"]
            assert bundle.model_types == family.model_types and bundle.patches
            assert len(bundle.patches) == len(family.all_experts)
            assert set(bundle.conversions) == set(family.conversion_keys)


def test_a_new_stock_layout_family_is_derived_with_no_code_change(monkeypatch):
    # As a transformers release that adds a MoE family with the stock fused layout would look to discovery.
    from layerswap import families
    from layerswap._hf.discovery import DiscoveredFamily, ExpertsDeclaration

    new = DiscoveredFamily(
        module_name="brand_new_moe",
        model_types=("brand_new_moe",),
        experts=(ExpertsDeclaration("BrandNewMoeExperts", decorated=True, layout=(), own_gate=False),),
        routers=("BrandNewMoeTopKRouter",),
        attentions=("BrandNewMoeAttention",),
    )
    # And a vision-language one, its experts in the text model: the bundles cover every one of its model types.
    new_vl = DiscoveredFamily(
        module_name="brand_new_vl",
        model_types=("brand_new_vl", "brand_new_vl_text", "brand_new_vl_vision"),
        experts=(ExpertsDeclaration("BrandNewVlTextExperts", decorated=True, layout=(), own_gate=False),),
        routers=("BrandNewVlTextTopKRouter",),
        attentions=(),
    )
    monkeypatch.setattr(families, "discover", lambda: (*discover(), new, new_vl))
    monkeypatch.setattr(
        families,
        "_GENERATIVE",
        ({"brand_new_moe": "BrandNewMoeForCausalLM"}, {"brand_new_vl": "BrandNewVlForConditionalGeneration"}),
    )
    derived, _ = families._derive()
    (vl,) = [f for f in derived if f.model_type == "brand_new_vl"]
    assert vl.sub_model_types == ("brand_new_vl_text", "brand_new_vl_vision")
    assert vl.experts == "BrandNewVlTextExperts" and vl.router == "BrandNewVlTextTopKRouter"
    from layerswap.swaps import quant

    assert set(quant.build(vl).conversions) == {"brand_new_vl", "brand_new_vl_text", "brand_new_vl_vision"}
    (row,) = [f for f in derived if f.model_type == "brand_new_moe"]
    assert row.experts == "BrandNewMoeExperts" and row.router == "BrandNewMoeTopKRouter"
    assert row.modeling_module == "transformers.models.brand_new_moe.modeling_brand_new_moe"
    from layerswap.swaps import PURPOSES

    bundles = {b.name for build in PURPOSES.values() if (b := build(row)) is not None}
    assert {"brand_new_moe-quant", "brand_new_moe-fast"} <= bundles
    # The same family with another layout is listed, naming what it declares.
    odd = DiscoveredFamily(
        "odd_moe",
        ("odd_moe",),
        (ExpertsDeclaration("OddMoeExperts", True, (("has_pre_expert_norm", "True"),), False),),
        (),
        (),
    )
    monkeypatch.setattr(families, "discover", lambda: (odd,))
    assert "OddMoeExperts(has_pre_expert_norm=True)" in families._derive()[1]["odd_moe"]


def test_derived_rows_are_the_families_no_typed_row_covers():
    typed = {f.model_type for f in FAMILIES[: len(FAMILIES) - len(DERIVED)]}
    assert typed.isdisjoint(f.model_type for f in DERIVED)
