"""Skip marks for tests of bundles that the installed transformers is too old for, with layerswap._compat's own
reason (the one enable_bundle raises), so a run on the oldest supported release says what it did not test."""

import pytest

from layerswap import _compat


def needs(kind: str) -> pytest.MarkDecorator:
    """Skip unless bundles of `kind` ("fused_qkv", "fast", "replay", ...) work with the installed transformers."""
    reason = _compat.unsupported_reason(kind)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def needs_bundle(name: str) -> pytest.MarkDecorator:
    """Skip unless bundle `name` can be enabled with the installed transformers."""
    import layerswap

    bundle = layerswap.get_bundle(name)
    reasons = [r for r in map(_compat.unsupported_reason, _compat.swap_kinds(bundle)) if r is not None]
    return pytest.mark.skipif(bool(reasons), reason=f"{name}: " + "; ".join(reasons))


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
