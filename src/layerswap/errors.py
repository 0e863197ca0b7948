"""Every exception layerswap raises, in one place. Every error on bad input is a BundleError, but for the fused-MoE
kernels' KernelInputError, a ValueError of `layerswap.kernels` (which imports nothing above it) re-exported here."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from .kernels.configs import KernelInputError  # noqa: F401  (re-exported: every exception is here)


class BundleError(Exception):
    """Base class of every error layerswap raises on bad input or unsupported combinations."""


class UnknownBundleError(BundleError):
    """A bundle name that is not in the catalog."""


class BundleConflictError(BundleError):
    """Two bundles (or a bundle and a user patch) replace the same transformers class differently."""


class UnsupportedTransformersError(BundleError):
    """The installed transformers lacks a class or internal that a bundle relies on."""


class MissingExpertWeightsError(BundleError):
    """A checkpoint lacks weights of modules layerswap swapped in (experts, fused attention); loading them
    randomly initialised would silently corrupt the model."""


class CheckpointNeedsBundleError(BundleError):
    """A checkpoint whose config.json records that layerswap saved it under bundles (quantized experts saved one
    by one), loaded without them: its weights do not fit the stock modules, which would be left randomly
    initialised."""


class WeightConversionError(BundleError, RuntimeError):
    """A quantizer or conversion op failed on weights the checkpoint has, so transformers skipped them (stock
    transformers raises RuntimeError for the same load; this is one too)."""


class CheckpointShapeError(BundleError, RuntimeError):
    """A checkpoint tensor of a module layerswap swapped in has another shape than the module (a checkpoint of
    another config). Stock transformers raises RuntimeError for the same load; this is one too."""


class AdapterLayoutError(BundleError):
    """A PEFT adapter has weights for modules the model lacks (one trained on a '-quant' model's per-expert
    nn.Linear experts, loaded onto a model without the bundle): PEFT would leave them untrained."""


class IncompatibleQuantizerError(BundleError):
    """A quantizer that cannot work with a bundle's module layout."""


class ExpertsImplementationError(BundleError):
    """An `experts_implementation` that experts layerswap swapped in cannot run (the '-quant' bundles' per-expert
    nn.Linear layers have no fused 3D weights for grouped_mm or batched_mm)."""


class FusedQKVParallelismError(BundleError):
    """Tensor parallelism was requested for a model whose attention layerswap fused."""


class ExpertParallelismError(BundleError, ValueError):
    """Expert parallelism was requested in a form the experts layerswap swapped in cannot take: an expert-parallel
    size that does not split the experts into whole experts per rank (stock transformers raises ValueError for
    that once sharding starts; this is one too, raised before any weight is loaded), or experts of a layout that
    cannot be split by expert."""


class ShardedSaveError(BundleError, RuntimeError):
    """`save_pretrained` of a sharded model failed on another rank; nothing was written to the target folder."""


class RoutingMismatchError(BundleError):
    """Recorded routing whose layer count, token count or top_k does not fit the model or the input."""


class LayerswapWarning(UserWarning):
    """Something is probably not what the user intended, but nothing is lost."""


def closest_names(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """'did you mean' text for an error message, or a pointer to the full list."""
    matches = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    if matches:
        return "Closest names: " + ", ".join(repr(m) for m in matches) + "."
    return "Run `layerswap list` to see every bundle."
