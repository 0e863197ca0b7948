"""The transformers releases layerswap supports, and every transformers internal it touches.

layerswap swaps classes, wraps loading hooks and edits registries inside transformers, through names transformers
does not promise to keep. INTERNALS lists each of them with the first release that has it (found by installing
releases 5.0.0 to 5.24.0 and looking). At import, a transformers older than FLOOR, or one lacking an internal that
every bundle needs, is an ImportError naming the floor and what is missing, not an AttributeError deep inside a
load. An internal that only one kind of swap needs makes just those bundles refuse at `enable_bundle`
(`refuse_unsupported`), and `layerswap list` marks them (`bundle_requirement`).

CI tests FLOOR (`.ci/floor`, with `constraints/floor.txt`) and NEWEST_TESTED (`.ci/run`, `constraints/newest.txt`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import transformers
from packaging.version import Version

from ..errors import UnsupportedTransformersError

if TYPE_CHECKING:
    from ..bundle import Bundle

TRANSFORMERS_VERSION: str = transformers.__version__

# The oldest release CI tests. llm-compressor 0.14, a major quantization pipeline, pins transformers>=5.15,<=5.17;
# '-quant' and '-replay' work there. Older releases lack nothing every bundle needs down to 5.13, but are untested.
FLOOR = "5.15.0"
# The newest release CI tests. 5.25 needs kernels>=0.19.1, which CI's package index does not have.
NEWEST_TESTED = "5.24.0"
# As pyproject.toml declares it (a test checks that they agree).
SUPPORTED = ">=5.15,<5.25"

# What a kind of swap that needs an internal is called in messages.
KINDS = {
    "fused_qkv": "fused q/k/v attention (the '-fused_qkv' bundles, and the '-fast' bundles that fuse attention)",
    "replay": "the '-replay' bundles",
}


@dataclass(frozen=True)
class Internal:
    module: str
    attribute: str  # a dotted path inside `module`, e.g. "PreTrainedModel._finalize_model_loading"
    since: str  # the first transformers release that has it
    use: str  # what layerswap does with it
    needed_for: str | None = None  # None: every bundle needs it (import fails without); else a key of KINDS
    fallback: str | None = (
        None  # set when layerswap works without it (then it is never an error): what it does
    )
    own: bool = False  # layerswap wraps it in that class's own __dict__ (not a base's) and puts it back
    static: bool = False  # ... and unwraps it through `__func__`: it must be a staticmethod there

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


_MU, _MP, _CM, _CML = (
    "transformers.modeling_utils",
    "transformers.monkey_patching",
    "transformers.conversion_mapping",
    "transformers.core_model_loading",
)
_HFQ, _MOE = "transformers.quantizers.base", "transformers.integrations.moe"

INTERNALS: tuple[Internal, ...] = (
    # class swapping (registry, _hf.patching)
    Internal(_MP, "register_patch_mapping", "5.3", "registers a bundle's replacement classes"),
    Internal(_MP, "unregister_patch_mapping", "5.3", "removes them on disable"),
    Internal(_MP, "get_patch_mapping", "5.3", "checks conflicts; swaps classes while a model is built"),
    Internal(
        _MP,
        "_find_replacement_class",
        "5.3",
        "matches class names as transformers does, for the cheap class swap",
        fallback="transformers' own apply_patches swaps the classes (about 0.3 s more per model build)",
    ),
    Internal(_MU, "apply_patches", "5.3", "wrapped: restores swapped classes on error, one build at a time"),
    Internal(_MU, "patch_output_recorders", "5.3", "wrapped: journals `_can_record_outputs` to restore it"),
    Internal(
        _MU,
        "PreTrainedModel._tied_weights_keys",
        "5.0",
        "a swapped model's tie patterns that name stock experts parameters name its per-expert ones",
    ),
    Internal(
        _MU,
        "PreTrainedModel._finalize_model_loading",
        "5.2",
        "wrapped: refuses missing swapped weights, keeps quantized swapped layers saving as loaded",
        static=True,
    ),
    # checkpoint conversions (_hf.conversions, swaps/*/conversion.py)
    Internal(_CM, "register_checkpoint_conversion_mapping", "5.0", "registers a bundle's conversions"),
    Internal(_CM, "get_checkpoint_conversion_mapping", "5.0", "reads the stock conversions"),
    Internal(_CM, "_checkpoint_conversion_mapping_cache", "5.0", "restores the stock conversions exactly"),
    Internal(_CM, "USER_REGISTERED_MAPPINGS", "5.13", "restores whether a model type was user-registered"),
    Internal(_CM, "get_model_conversion_mapping", "5.0", "gives a from_config model its save conversions"),
    Internal(_CML, "WeightTransform", "5.0", "conversion types the bundles build"),
    Internal(_CML, "WeightConverter", "5.0", "conversion types the bundles build"),
    Internal(_CML, "WeightRenaming", "5.0", "conversion types the bundles build"),
    Internal(_CML, "ConversionOps", "5.0", "base of layerswap's own conversion ops"),
    Internal(_CML, "MergeModulelist", "5.0", "reads and rebuilds the stock expert conversions"),
    Internal(_CML, "Concatenate", "5.0", "reads and rebuilds the stock expert conversions"),
    Internal(
        _CML,
        "PrefixChange",
        "5.6",
        "left out of a from_config model's save conversions, as transformers does",
    ),
    # quantizers (_hf.quantizers, memory)
    Internal(
        _HFQ,
        "HfQuantizer.preprocess_model",
        "5.0",
        "wrapped: refuses finegrained_fp8 with '-quant'",
        own=True,
    ),
    Internal(
        _HFQ,
        "HfQuantizer.get_modules_to_not_convert",
        "5.0",
        "wrapped: adds the bundles' keep-unquantized modules",
        static=True,
    ),
    Internal(_HFQ, "HfQuantizer.get_quantize_ops", "5.0", "made to quantize one weight per call"),
    Internal(
        "transformers.quantizers.quantizers_utils",
        "should_convert_module",
        "5.0",
        "memory.bnb_replaced_linears predicts bitsandbytes' choices",
    ),
    # experts (_hf.experts, swaps/fast)
    Internal(_MOE, "ALL_EXPERTS_FUNCTIONS._local_mapping", "5.0", "register_experts_backend's exact undo"),
    Internal(_MOE, "_default_apply_gate", "5.0", "the fused kernels refuse Experts that override the gate"),
    Internal("transformers.activations", "GELUActivation", "5.0", "maps activations to fused-kernel names"),
    Internal("transformers.activations", "GELUTanh", "5.0", "maps activations to fused-kernel names"),
    Internal("transformers.activations", "SiLUActivation", "5.0", "maps activations to fused-kernel names"),
    # output recording (_hf.recorders)
    Internal("transformers.utils.output_capturing", "OutputRecorder", "5.2", "journals and adds recorders"),
    Internal(
        "transformers.utils.output_capturing",
        "_CAN_RECORD_REGISTRY",
        "5.2",
        "points models built meanwhile back at the stock recorders on disable",
        fallback="there is no registry to restore",
    ),
    Internal(
        "transformers.utils.generic",
        "maybe_autocast",
        "5.0",
        "ernie4_5_moe's replayable router scores as stock does",
        needed_for="replay",
    ),
    Internal(
        "transformers.models.phimoe.modeling_phimoe",
        "PhimoeMultiplier",
        "5.0",
        "phimoe's replayable router in training mode",
        needed_for="replay",
    ),
    # tensor parallelism (_hf.parallel)
    Internal(
        "transformers.distributed.mixin",
        "DistributedMixin._resolve_parallel_plans",
        "5.23",
        "wrapped: refuses tensor-parallel plans that would shard a fused qkv_proj, and expert-parallel sizes the "
        "swapped experts cannot take",
        needed_for="fused_qkv",
        own=True,
    ),
    Internal(
        "transformers.distributed.expert_parallel",
        "EpDispatchExpertsParallel.install_forward",
        "5.24",  # the release checked; older ones were not
        "wrapped: '-quant' experts keep only this rank's experts when the expert-parallel dispatch is installed",
        fallback="'-quant' experts stay whole on every rank under expert parallelism",
        own=True,
    ),
    Internal(
        "transformers.distributed.mixin",
        "DistributedMixin.gather_sharded_state_dict_for_save",
        "5.24",  # the release checked; older ones were not
        "wrapped: a save gathers each '-quant' expert from the rank that holds it under expert parallelism",
        fallback="'-quant' experts stay whole on every rank under expert parallelism",
        own=True,
    ),
    Internal(
        "transformers.distributed.mixin",
        "DistributedMixin.barrier_after_gathered_checkpoint_save",
        "5.24",  # the release checked; older ones were not
        "skipped on the saving model during a sharded save: layerswap's all-ranks agreement on the outcome is "
        "the barrier",
        fallback="a failed sharded save of a swapped model is not made all-or-nothing",
    ),
    Internal(
        "transformers.distributed.sharding_utils",
        "DtensorShardOperation.shard_tensor",
        "5.24",  # the release checked; older ones were not
        "wrapped: a fused experts tensor loading into '-quant' per-expert weights is read whole, then cut per "
        "expert",
        fallback="'-quant' loads of fused checkpoints are not made tensor-parallel-safe",
        own=True,
    ),
)
# Stock routers that returned something else before the release given (granitemoe's (indices, weights, logits),
# longcat_flash's (weights, indices)), where every other router (and every replayable router layerswap builds)
# returns (logits, scores, indices): their '-replay' bundles need it. What a router returns shows only in its
# forward, so this is the one check by version. Checked in the releases' wheels.
ROUTER_ORDER_SINCE = {
    "GraniteMoeTopKRouter": ("5.21", "(indices, weights, logits)"),
    "GraniteMoeSharedTopKRouter": ("5.21", "(indices, weights, logits)"),
    "LongcatFlashTopkRouter": ("5.19", "(weights, indices)"),
}


def router_order_shortfall(router: str) -> tuple[str, str] | None:
    """(the release needed, what the router returns before it) where the installed transformers' `router` does
    not yet return (logits, scores, indices); None where it does."""
    since, returns = ROUTER_ORDER_SINCE.get(router, (None, None))
    if since is None or Version(TRANSFORMERS_VERSION) >= Version(since):
        return None
    return since, returns


_ABSENT = object()


def lacks(internal: Internal) -> str | None:
    """Why the installed transformers cannot give `internal` ("absent", "no module ...", ...), or None."""
    try:
        owner = importlib.import_module(internal.module)
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == internal.module:
            return f"no module {internal.module}"
        return f"{internal.module} fails to import ({error})"
    *path, last = internal.attribute.split(".")
    for part in path:
        owner = getattr(owner, part, _ABSENT)
        if owner is _ABSENT:
            return "absent"
    if internal.own or internal.static:
        value = vars(owner).get(last, _ABSENT) if isinstance(owner, type) else _ABSENT
        if value is _ABSENT:
            return (
                "absent"
                if not hasattr(owner, last)
                else f"not defined on {path[-1] if path else internal.module} itself"
            )
        if internal.static and not isinstance(value, staticmethod):
            return f"not a staticmethod ({type(value).__name__})"
        return None
    return None if hasattr(owner, last) else "absent"


def missing_internals(needed_for: str | None = None) -> list[tuple[Internal, str]]:
    """(internal, why) for each internal that `needed_for` needs (None: every bundle) and transformers lacks."""
    missing = []
    for internal in INTERNALS:
        if internal.fallback is not None or internal.needed_for != needed_for:
            continue
        why = lacks(internal)
        if why is not None:
            missing.append((internal, why))
    return missing


def _describe(missing: list[tuple[Internal, str]]) -> list[str]:
    return [
        f"{internal.name} (added in transformers {internal.since}; "
        + (f"{why}; " if why != "absent" else "")
        + f"layerswap {internal.use})"
        for internal, why in missing
    ]


def missing_for(kind: str) -> list[str]:
    """The internals that `kind` ("fused_qkv", "replay", or another bundle purpose) needs and the installed
    transformers lacks, described; empty when that kind of bundle works here."""
    return _describe(missing_internals(kind))


def needed_version(kind: str) -> str | None:
    """The oldest transformers release that has every internal `kind` needs, when the installed one lacks some."""
    missing = missing_internals(kind)
    return max((i.since for i, _ in missing), key=Version) if missing else None


def bundle_requirement(bundle: Bundle) -> str | None:
    """ "transformers >= X" when the installed transformers is too old for `bundle`, else None."""
    shortfalls = _shortfalls(bundle)
    return f"transformers >= {max((v for v, _ in shortfalls), key=Version)}" if shortfalls else None


def unsupported_reason(kind: str) -> str | None:
    """Why bundles of `kind` do not work with the installed transformers (None when they do)."""
    missing = missing_for(kind)
    if not missing:
        return None
    return (
        f"{KINDS.get(kind, f'the {kind!r} bundles')} need transformers >= {needed_version(kind)}; "
        f"the installed transformers {TRANSFORMERS_VERSION} lacks " + "; ".join(missing)
    )


def _shortfalls(bundle: Bundle) -> list[tuple[str, str]]:
    """(the release needed, why) for each thing the installed transformers is too old for in `bundle`."""
    shortfalls = [(needed_version(k), r) for k in bundle.needs if (r := unsupported_reason(k)) is not None]
    for patch in bundle.patches:
        shortfall = router_order_shortfall(patch.class_name)
        if shortfall is not None:
            since, returns = shortfall
            shortfalls.append(
                (
                    since,
                    f"{patch.class_name} in transformers {TRANSFORMERS_VERSION} returns {returns}, and its MoE "
                    f"block unpacks it so; a replayable router returns (logits, scores, indices), as stock does "
                    f"from transformers {since} on",
                )
            )
    return shortfalls


def refuse_unsupported(bundle: Bundle) -> None:
    """Raise UnsupportedTransformersError when the installed transformers is too old for `bundle`."""
    shortfalls = _shortfalls(bundle)
    if shortfalls:
        needed = max((v for v, _ in shortfalls), key=Version)
        raise UnsupportedTransformersError(
            f"Bundle {bundle.name!r} needs transformers >= {needed}: "
            + "; ".join(reason for _, reason in shortfalls)
            + f". Upgrade with `pip install 'transformers>={needed},{SUPPORTED.split(',')[1]}'`, or use another "
            "bundle for this family (`layerswap list` marks the ones this transformers supports)."
        )


def unsupported_message(version: str, missing: list[tuple[Internal, str]]) -> str | None:
    """The ImportError message for transformers `version` lacking `missing`, or None when it is supported."""
    below_floor = Version(version) < Version(FLOOR)
    if not missing and not below_floor:
        return None
    found = f"the installed transformers {version}"
    if below_floor:
        found += f" is older than {FLOOR}, the oldest release CI tests" + (", and" if missing else "")
    if missing:
        found += " lacks " + "; ".join(_describe(missing))
    return (
        f"layerswap needs transformers >= {FLOOR.rsplit('.', 1)[0]} (supported: {SUPPORTED}; CI tests {FLOOR} "
        f"and {NEWEST_TESTED}); {found}. Install a supported release: `pip install 'transformers{SUPPORTED}'`."
    )


def check_transformers() -> None:
    missing = missing_internals()
    if Version(TRANSFORMERS_VERSION) < Version(FLOOR):  # say also what the other kinds of bundle would lack
        missing += [m for kind in KINDS for m in missing_internals(kind)]
    message = unsupported_message(TRANSFORMERS_VERSION, missing)
    if message is not None:
        raise ImportError(message)


check_transformers()
