#!/usr/bin/env bash
# GPU check of the Triton fused-MoE kernels, for a CUDA machine (one H100/H200-class GPU: under 8 minutes).
#   1. tests/kernels with the compiled kernels (TRITON_INTERPRET unset), bf16 cases included;
#   2. a bf16 latency sweep, T = 1, 16, 512, 4096, at both benchmark shapes, against stock grouped_mm and
#      batched_mm, printing each ratio and, at decode (T=1, bound by reading the active experts' weights),
#      the share of the memory-bandwidth roofline.
# Usage: bash benchmarks/gpu_check.sh [output dir, default bench-out]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out}"
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

python - <<'PY'
import torch, triton, transformers
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU; on CPU run pytest tests/kernels instead"
print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} "
      f"| transformers {transformers.__version__}")
PY

echo "# 1/2 kernel tests (compiled Triton, bf16 included)"
timeout 240 python -m pytest tests/kernels -q -p no:cacheprovider -rs

echo "# 2/2 latency sweep"
timeout 300 python benchmarks/bench_fused_moe.py --device cuda --dtypes bfloat16 --tokens 1 16 512 4096 \
    --providers grouped_mm batched_mm layerswap --reps 50 --budget 3 --batched-mm-limit-gib 40 \
    --out "$out/gpu_fused_moe.csv"

python - "$out/gpu_fused_moe.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
bandwidth = next(r["median"] for r in rows if r["provider"] == "memory_bandwidth")
print(f"# decode (T=1) share of the memory-bandwidth roofline ({float(bandwidth):.0f} GB/s measured):")
for r in rows:
    if r["T"] == "1" and r["metric"] == "roofline_share":
        print(f"  {r['shape']:18} {r['dtype']:9} {r['provider']:11} {100 * float(r['median']):5.1f}%")
print("# layerswap / best stock (below 1 is faster):")
for r in rows:
    if r["provider"] == "layerswap" and r["metric"] == "ratio_vs_best_stock":
        print(f"  {r['shape']:18} {r['dtype']:9} T={r['T']:>5} {float(r['median']):.2f}x")
PY
