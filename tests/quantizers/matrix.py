"""One row of the quantizer compatibility matrix: a tiny checkpoint loaded through a transformers quantization
config, with and without the family's `-quant` bundle.

Shared by tests/quantizers/test_matrix.py and tests/quantizers/write_doc.py (which writes docs/quantizers.md),
so the committed table and the tests measure the same thing. Measurements are cached per process: the doc
freshness test reuses what the parametrized tests just measured.

What a row reports:
- expert share: `layerswap.report(model).expert_quantized_share` (logical expert parameters in quantized linear
  layers). `quantized_by_class` counts the same layers with each quantizer's own classes, independently of
  report.py, so a detection gap in report.py shows as a disagreement instead of a silent 0%.
- logit error: max |logits - unquantized logits|, and that divided by max |unquantized logits|, on
  tiny_input_ids().
- expert-output error: the same ratio for each layer's experts alone, fed the unquantized model's inputs.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

import layerswap
from _support.tiny_models import tiny_input_ids, tiny_model
from layerswap.swaps.quant.modules import LinearExperts

# The families every scheme's table covers, one per layout: shared expert + 1-wide gate (qwen2_moe), w1/w3/w2
# names (mixtral), per-head q/k norms (qwen3_moe), whole-width q/k norms (olmoe), MLA + group routing (deepseek_v3).
MATRIX_FAMILIES = ("qwen2_moe", "mixtral", "qwen3_moe", "olmoe", "deepseek_v3")

# bitsandbytes' CPU kernels reject some NON-expert projections at tiny sizes (deepseek_v3's MLA low-rank
# projections): same skips as tests/quantizers/test_bitsandbytes.py. Experts are always quantized.
BNB_TINY_SIZE_SKIPS = {"deepseek_v3": [r".*self_attn"]}

PACKAGES = ("torch", "transformers", "bitsandbytes", "accelerate", "torchao", "optimum-quanto", "hqq")


# --- how each quantizer's layers look ----------------------------------------------------------------------


def _is_bnb_layer(module: nn.Module) -> bool:
    return type(module).__name__ in {"Linear4bit", "Linear8bitLt"}


def _is_torchao_layer(module: nn.Module) -> bool:
    # torchao >= 0.12 quantizes in place: the module stays nn.Linear, its weight becomes a TorchAOBaseTensor
    # subclass (Int8Tensor for Int8WeightOnlyConfig in 0.18; AffineQuantizedTensor in older releases).
    weight = getattr(module, "weight", None)
    return any(c.__name__ == "TorchAOBaseTensor" for c in type(weight).__mro__)


def _is_quanto_layer(module: nn.Module) -> bool:
    from optimum.quanto import QModuleMixin

    return isinstance(module, QModuleMixin)


def _is_hqq_layer(module: nn.Module) -> bool:
    from hqq.core.quantize import HQQLinear

    return isinstance(module, HQQLinear)


# --- schemes -----------------------------------------------------------------------------------------------


def _bnb(**kwargs: Any) -> Callable[[str], Any]:
    def build(model_type: str) -> Any:
        from transformers import BitsAndBytesConfig

        skips = BNB_TINY_SIZE_SKIPS.get(model_type)
        extra = {"llm_int8_skip_modules": [*skips, "lm_head"]} if skips else {}
        return BitsAndBytesConfig(**kwargs, **extra)

    return build


def _torchao_int8_weight_only(model_type: str) -> Any:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _quanto_int8(model_type: str) -> Any:
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


def _hqq_config(model_type: str) -> Any:
    from transformers import HqqConfig

    return HqqConfig(nbits=4, group_size=64)


def _load_with_config(scheme: Scheme, directory: Path, model_type: str) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=scheme.build(model_type))


def _load_then_hqq_linear(scheme: Scheme, directory: Path, model_type: str) -> nn.Module:
    """hqq's documented layer API, `HQQLinear(linear, quant_config, ...)`, with HqqConfig's settings: every
    nn.Linear that a transformers quantizer would convert (same skip list, so bundle hints apply) is replaced."""
    from hqq.core.quantize import HQQLinear
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    model = AutoModelForCausalLM.from_pretrained(directory)
    skip = HfQuantizer.get_modules_to_not_convert(model)
    # optimize=False: HQQ's half-quadratic refinement takes ~0.2 s per layer on CPU, and this row checks
    # coverage and wiring, not HQQ's best accuracy.
    config = scheme.build(model_type).quant_config
    config["weight_quant_params"]["optimize"] = False
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and should_convert_module(name, skip):
            parent, _, child = name.rpartition(".")
            layer = HQQLinear(module, config, compute_dtype=torch.float32, device="cpu")
            setattr(model.get_submodule(parent), child, layer)
    return model


@dataclass(frozen=True)
class Scheme:
    key: str  # pytest id and cache key
    quantizer: str  # the table's "quantizer" column
    label: str  # the table's "scheme" column
    bits: int  # weight bits, for the tests' error bounds
    build: Callable[[str], Any]
    quantized_by_class: Callable[[nn.Module], bool]
    families: tuple[str, ...] = MATRIX_FAMILIES
    load: Callable[[Scheme, Path, str], nn.Module] = _load_with_config
    notes: str = ""


SCHEMES: tuple[Scheme, ...] = (
    Scheme(
        "bnb-nf4",
        "bitsandbytes",
        "nf4 (BitsAndBytesConfig load_in_4bit)",
        4,
        _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
        _is_bnb_layer,
    ),
    Scheme(
        "bnb-fp4",
        "bitsandbytes",
        "fp4 (BitsAndBytesConfig load_in_4bit)",
        4,
        _bnb(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
        _is_bnb_layer,
    ),
    Scheme(
        "bnb-int8",
        "bitsandbytes",
        "int8 (BitsAndBytesConfig load_in_8bit)",
        8,
        _bnb(load_in_8bit=True),
        _is_bnb_layer,
    ),
    Scheme(
        "torchao-int8wo",
        "torchao",
        "int8 weight-only (TorchAoConfig(Int8WeightOnlyConfig()))",
        8,
        _torchao_int8_weight_only,
        _is_torchao_layer,
    ),
    Scheme(
        "quanto-int8",
        "optimum-quanto",
        "int8 weights (QuantoConfig(weights='int8'))",
        8,
        _quanto_int8,
        _is_quanto_layer,
    ),
    Scheme(
        "hqq-linear",
        "hqq",
        "4-bit g64 (hqq's HQQLinear on each nn.Linear, after load)",
        4,
        _hqq_config,
        _is_hqq_layer,
        load=_load_then_hqq_linear,
        notes="hqq's own API, as transformers' HqqConfig cannot quantize on load (see the HqqConfig row); "
        "optimize=False",
    ),
    Scheme(
        "hqq-config", "hqq", "4-bit g64 (HqqConfig)", 4, _hqq_config, _is_hqq_layer, families=("qwen2_moe",)
    ),
)
SCHEMES_BY_KEY = {s.key: s for s in SCHEMES}


# --- measuring ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One load (scheme x family x bundle-or-stock). `load_error` / `forward_error` hold 'Type: message'."""

    scheme: str
    family: str
    bundle: bool
    load_error: str | None = None
    expert_share: float | None = None  # from layerswap.report
    expert_layers: int = 0  # expert linear layers (stock: 3 per expert, as the 3D tensors hold them)
    expert_layers_quantized: int = 0  # by the quantizer's own classes, independently of report.py
    forward_error: str | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    expert_rel_error: float | None = None  # experts alone, on the unquantized model's inputs
    report_warnings: tuple[str, ...] = field(default=())

    @property
    def class_share(self) -> float:
        return self.expert_layers_quantized / self.expert_layers if self.expert_layers else 0.0

    @property
    def forward_ok(self) -> bool:
        return self.load_error is None and self.forward_error is None


_checkpoint_root: Path | None = None


def _root() -> Path:
    global _checkpoint_root
    if _checkpoint_root is None:
        _checkpoint_root = Path(tempfile.mkdtemp(prefix="layerswap-quant-matrix-"))
        atexit.register(shutil.rmtree, _checkpoint_root, ignore_errors=True)
    return _checkpoint_root


@dataclass(frozen=True)
class Reference:
    """The unquantized model's logits, and each experts module's inputs and output during that forward."""

    directory: Path
    logits: torch.Tensor
    experts: dict[str, tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]]


def _is_experts_module(module: nn.Module) -> bool:
    return isinstance(module, LinearExperts) or isinstance(
        getattr(module, "gate_up_proj", None), nn.Parameter
    )


@functools.cache
def checkpoint(family: str, layout: str = "stock") -> Reference:
    """A tiny checkpoint saved once per process, and its unquantized forward. `layout` "stock": as stock
    `save_pretrained` writes it (per-expert keys for most families); "fused": the 3D experts tensors as they are in
    memory (`save_original_format=False`), which the bundle splits on load."""
    model = tiny_model(family)
    directory = _root() / f"{family}-{layout}"
    model.save_pretrained(directory, save_original_format=layout != "fused")
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
        ) -> None:
            # Cloned: the caller may add the shared expert's output into this tensor in place.
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            captured[name] = (
                tuple(clone(a) for a in args),
                {k: clone(v) for k, v in kwargs.items()},
                clone(output),
            )

        return hook

    handles = [
        module.register_forward_hook(keep(name), with_kwargs=True)
        for name, module in model.named_modules()
        if _is_experts_module(module)
    ]
    try:
        with torch.no_grad():
            logits = model(tiny_input_ids()).logits
    finally:
        for handle in handles:
            handle.remove()
    return Reference(directory, logits, captured)


def _expert_output_error(model: nn.Module, reference: Reference) -> float:
    """Max over layers of max |experts(x) - unquantized experts(x)| / max |unquantized experts(x)|, with each
    layer fed the unquantized model's own inputs, so it measures the experts alone (in these tiny random
    models the attention projections dominate the logit error)."""
    worst = 0.0
    with torch.no_grad():
        for name, (args, kwargs, expected) in reference.experts.items():
            output = model.get_submodule(name)(*args, **kwargs)
            worst = max(worst, ((output.float() - expected).abs().max() / expected.abs().max()).item())
    return worst


def _count_expert_layers(
    model: nn.Module, quantized_by_class: Callable[[nn.Module], bool]
) -> tuple[int, int]:
    total = quantized = 0
    for module in model.modules():
        if isinstance(module, LinearExperts):
            for expert in module:
                for layer in expert.children():
                    if hasattr(layer, "in_features") or quantized_by_class(layer):
                        total += 1
                        quantized += quantized_by_class(layer)
        elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
            # Stock fused experts: 3D tensors no quantizer here converts (the point of the -quant bundle).
            total += 3 * module.gate_up_proj.shape[0]
    return total, quantized


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".strip()


@functools.cache
def measure(scheme_key: str, family: str, bundle: bool, layout: str = "stock") -> Measurement:
    scheme = SCHEMES_BY_KEY[scheme_key]
    reference = checkpoint(family, layout)
    common = {"scheme": scheme_key, "family": family, "bundle": bundle}
    try:
        if bundle:
            with layerswap.use_bundle(f"{family}-quant"):
                model = scheme.load(scheme, reference.directory, family)
        else:
            model = scheme.load(scheme, reference.directory, family)
    except Exception as error:  # a row that cannot load is a result of the matrix, recorded as such
        return Measurement(**common, load_error=_describe(error))
    summary = layerswap.report(model)
    total, quantized = _count_expert_layers(model, scheme.quantized_by_class)
    measured = {
        "expert_share": summary.expert_quantized_share,
        "expert_layers": total,
        "expert_layers_quantized": quantized,
        "report_warnings": summary.warnings,
    }
    try:
        with torch.no_grad():
            logits = model(tiny_input_ids()).logits
    except Exception as error:
        return Measurement(**common, **measured, forward_error=_describe(error))
    if not torch.isfinite(logits).all():
        return Measurement(**common, **measured, forward_error="non-finite logits")
    difference = (logits.float() - reference.logits).abs().max().item()
    return Measurement(
        **common,
        **measured,
        max_abs_error=difference,
        max_rel_error=difference / reference.logits.abs().max().item(),
        expert_rel_error=_expert_output_error(model, reference),
    )


def matrix_keys(schemes: tuple[Scheme, ...] = SCHEMES) -> list[tuple[str, str]]:
    return [(s.key, family) for s in schemes for family in s.families]


# --- the table ---------------------------------------------------------------------------------------------

HEADER = "Generated by `python tests/quantizers/write_doc.py` from a fresh run; do not edit by hand."
COLUMNS = (
    "quantizer",
    "scheme",
    "family",
    "experts quantized stock",
    "with bundle",
    "forward",
    "max rel. logit error",
    "stock's logit error",
    "max rel. expert-output error",
    "notes",
)
NUMERIC_COLUMNS = ("max rel. logit error", "stock's logit error", "max rel. expert-output error")

# Failures the matrix has measured, by a substring of their message, with the reason found for each.
KNOWN_FAILURES = {
    "N must be divisible by block_n": "bitsandbytes' CPU 4-bit kernel rejects the 1-wide shared_expert_gate, "
    "which the -quant bundle keeps unquantized",
    "is invalid for input of size 0": "HQQ cannot quantize the 1-wide shared_expert_gate, which the -quant "
    "bundle keeps unquantized",
    "HQQ is not available yet": "transformers' HqqHfQuantizer has no get_quantize_ops, so HqqConfig cannot "
    "quantize on load, with or without a bundle",
}


def explain(message: str) -> str:
    for substring, reason in KNOWN_FAILURES.items():
        if substring in message:
            return f"{message} ({reason})"
    return message


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def versions_line() -> str:
    return "Versions: " + ", ".join(f"{name} {version}" for name, version in versions().items())


# bitsandbytes' CPU 4-bit kernels differ by CPU feature: with AVX512-BF16 its inference path rejects a 1-wide
# output (qwen2_moe's shared_expert_gate), without it the same stock load runs. Rows measured on one kind of CPU
# say so, and the freshness test compares the columns that depend on it only on the same kind.
CPU_FEATURES = ("avx512_bf16", "amx_bf16", "avx2")
MACHINE_DEPENDENT_COLUMNS = ("stock's logit error", "notes")


def cpu_features() -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return dict.fromkeys(CPU_FEATURES, False)
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return {feature: feature in flags for feature in CPU_FEATURES}


def machine_line() -> str:
    features = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in cpu_features().items())
    return f"CPU features: {features}"


def _share(m: Measurement) -> str:
    return "-" if m.load_error else f"{m.expert_share:.0%}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _forward(m: Measurement) -> str:
    return "load fails" if m.load_error else "fails" if m.forward_error else "ok"


def row_cells(scheme_key: str, family: str) -> tuple[str, ...]:
    """The table row for one (scheme, family): forward and errors of the bundle's load, plus the stock load's
    expert share, logit error and any failure."""
    scheme = SCHEMES_BY_KEY[scheme_key]
    stock, ours = measure(scheme_key, family, False), measure(scheme_key, family, True)
    notes = [scheme.notes] if scheme.notes else []
    for m in (stock, ours):
        side = "bundle" if m.bundle else "stock"
        if not m.load_error and abs(m.expert_share - m.class_share) > 1e-9:
            notes.append(
                f"{side}: layerswap.report sees {m.expert_share:.0%}, but {m.expert_layers_quantized} of "
                f"{m.expert_layers} expert layers are {scheme.quantizer} layers"
            )
    if ours.load_error and stock.load_error == ours.load_error:
        notes.append(f"both loads: {explain(ours.load_error)}")
    else:
        for m in (stock, ours):
            failure = m.load_error or m.forward_error
            if failure:
                stage = "load" if m.load_error else "forward"
                notes.append(f"{'bundle' if m.bundle else 'stock'} {stage} fails: {explain(failure)}")
    return (
        scheme.quantizer,
        scheme.label,
        family,
        _share(stock),
        _share(ours),
        _forward(ours),
        _number(ours.max_rel_error),
        _number(stock.max_rel_error),
        _number(ours.expert_rel_error),
        "; ".join(notes).replace("|", "/"),
    )


def table_lines(keys: list[tuple[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(*key)) + " |" for key in keys]
    return lines


def parse_table(text: str) -> dict[tuple[str, str, str], dict[str, str]]:
    """The rows of a generated table, keyed by (quantizer, scheme, family), each as {column: cell}. Only the
    table under the matrix's own header row: the doc's hand-written text after it may hold tables of its own."""
    rows = {}
    in_matrix = False
    for line in text.splitlines():
        if line.startswith(f"| {COLUMNS[0]} |"):
            in_matrix = True
            continue
        if in_matrix and not line.startswith("| "):
            break
        if not in_matrix or line.startswith("| --- |"):
            continue
        cells = [cell.strip() for cell in line.strip()[2:-2].split(" | ")]
        rows[tuple(cells[:3])] = dict(zip(COLUMNS, cells, strict=False))
    return rows
