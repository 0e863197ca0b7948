"""Family lists for parametrized tests, straight from the catalog."""

from layerswap.catalog import FAMILIES

MOE_FAMILIES = [f for f in FAMILIES if f.experts is not None]
MOE_TYPES = [f.model_type for f in MOE_FAMILIES]
