"""Family lists for parametrized tests, straight from the catalog."""

from _support.transformers_support import row_as_installed
from layerswap.families import FAMILIES

# The rows as the installed transformers can test them: on a release older than the newest CI tests, a row whose
# model type or swapped classes are newer is left out, and one whose router class is newer loses its router
# (test_catalog reports each as skipped, saying what is newer).
INSTALLED_FAMILIES = [row for row in map(row_as_installed, FAMILIES) if row is not None]
MOE_FAMILIES = [f for f in INSTALLED_FAMILIES if f.experts is not None]
MOE_TYPES = [f.model_type for f in MOE_FAMILIES]
# The families with a '-fast' bundle: the fused kernels compute act(gate) * up, not a family's own gate.
FAST_FAMILIES = [f for f in MOE_FAMILIES if not f.own_gate and f.is_stock_layout]
