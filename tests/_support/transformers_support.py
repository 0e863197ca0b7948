"""Skip marks for tests of bundles that the installed transformers is too old for, with layerswap._hf.compat's own
reason (the one enable_bundle raises), so a run on the oldest supported release says what it did not test."""

import dataclasses
import importlib
import importlib.util

import pytest
from packaging.version import Version

from layerswap._hf import compat as _compat


def needs(kind: str) -> pytest.MarkDecorator:
    """Skip unless bundles of `kind` ("fused_qkv", "fast", "replay", ...) work with the installed transformers."""
    reason = _compat.unsupported_reason(kind)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def needs_bundle(name: str) -> pytest.MarkDecorator:
    """Skip unless bundle `name` can be enabled with the installed transformers."""
    import layerswap

    bundle = layerswap.get_bundle(name)
    reasons = [r for r in map(_compat.unsupported_reason, bundle.needs) if r is not None]
    return pytest.mark.skipif(bool(reasons), reason=f"{name}: " + "; ".join(reasons))


def needs_model_type(model_type: str) -> pytest.MarkDecorator:
    """Skip when the installed transformers is older than the newest tested and lacks `model_type`'s modeling
    module (a test that needs one family's own classes); on the newest tested release a missing one fails."""
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    version = _compat.TRANSFORMERS_VERSION
    package = importlib.util.find_spec(f"transformers.models.{model_type}")
    missing = Version(version) < Version(_compat.NEWEST_TESTED) and package is None
    return pytest.mark.skipif(missing, reason=f"transformers {version} has no {module} (newer model type)")


def every_bundle_supported() -> pytest.MarkDecorator:
    """Skip unless every bundle can be enabled (e.g. for checks of docs generated from the whole catalog)."""
    import layerswap

    unsupported = {
        b.name: need for b in layerswap.list_bundles() if (need := _compat.bundle_requirement(b)) is not None
    }
    reason = (
        f"{len(unsupported)} bundles need a newer transformers than {_compat.TRANSFORMERS_VERSION} "
        f"(e.g. {next(iter(unsupported), '')}: {next(iter(unsupported.values()), '')})"
    )
    return pytest.mark.skipif(bool(unsupported), reason=reason)


def row_missing(family) -> str | None:
    """What the installed transformers lacks of a catalog row (its modeling module, or a class the row names), as a
    skip reason; None when it has them all. Rows are written against the newest release CI tests, where a missing
    class is the row's error (test_catalog fails on it), so there this is always None."""
    version = _compat.TRANSFORMERS_VERSION
    if Version(version) >= Version(_compat.NEWEST_TESTED):
        return None
    try:
        module = importlib.import_module(family.modeling_module)
    except ModuleNotFoundError as error:
        if error.name is None or not family.modeling_module.startswith(error.name):
            raise
        return (
            f"transformers {version} has no {family.modeling_module}: model type {family.model_type!r} is newer "
            f"(the row is tested on {_compat.NEWEST_TESTED})"
        )
    names = (family.experts, family.router, family.attention)
    lacking = [name for name in names if name and not isinstance(getattr(module, name, None), type)]
    if not lacking:
        return None
    return (
        f"{family.modeling_module} in transformers {version} has no {', '.join(lacking)}: newer than {version} "
        f"(the row is tested on {_compat.NEWEST_TESTED})"
    )


def row_as_installed(family):
    """`family`'s row as the installed transformers can test it: None when it lacks the model type or a class the
    swaps replace, the row without its router when only the router class is newer (jamba's before 5.21)."""
    if row_missing(family) is None:
        return family
    if row_missing(dataclasses.replace(family, router=None)) is None:
        return dataclasses.replace(family, router=None)
    return None
