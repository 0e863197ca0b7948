"""Run transformers' own common model tests (`ModelTesterMixin`) with layerswap's bundles on.

The tests come from the sdist of the installed transformers release (`pip download transformers==<version>
--no-binary :all:`, cached under ~/.cache/layerswap/hf-common-tests/), unchanged: `tests/test_modeling_common.py`
and `tests/test_configuration_common.py`. The sdist does not ship the two mixins it imports for export and
generation tests; they are stubbed (those tests are not run). The per-family testers are layerswap's, built on
`layerswap.testing.tiny_config`.

Each family runs once stock, then once per bundle of the family, both with the bundle enabled (`plain`: the common
tests build their models with the constructor, so those stay stock and only from_pretrained swaps) and inside
`layerswap.apply_bundles()` (`construct`: every model is swapped). The report lists every test whose outcome
differs from stock, with the reason from docs/troubleshooting.md's table where it is by design.

    python tools/hf_common_tests.py                       # every family, every bundle, both modes
    python tools/hf_common_tests.py --families qwen2_moe --bundles quant --modes construct
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import transformers

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
PURPOSES = ("quant", "fused_qkv", "fast", "replay")
MODES = ("plain", "construct")
CACHE = Path(os.environ.get("LAYERSWAP_CACHE", Path.home() / ".cache" / "layerswap")) / "hf-common-tests"
TROUBLESHOOTING = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"
_TABLE_HEADING = "## transformers' common model tests with a bundle on"

_CONFTEST = """
import os

import pytest

import layerswap

BUNDLE = os.environ.get("LAYERSWAP_COMMON_BUNDLE")
MODE = os.environ.get("LAYERSWAP_COMMON_MODE", "plain")


@pytest.fixture(autouse=True)
def _bundle():
    if not BUNDLE:
        yield
        return
    layerswap.enable_bundle(BUNDLE)
    try:
        if MODE == "construct":
            with layerswap.apply_bundles():
                yield
        else:
            yield
    finally:
        layerswap.disable_bundle(BUNDLE)
"""

_TESTER = """
import importlib
import unittest

import torch

from layerswap.testing import tiny_config

from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

MODEL_TYPE = {model_type!r}
_module = importlib.import_module("transformers.models.{model_type}.modeling_{model_type}")
_prefix = {prefix!r}


class Tester:
    batch_size = 2
    seq_length = 7
    vocab_size = 128
    hidden_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    is_training = True

    def __init__(self, parent):
        self.parent = parent

    def get_config(self):
        return tiny_config(MODEL_TYPE)

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return config, {{"input_ids": input_ids, "attention_mask": attention_mask}}


class Test{prefix}Common(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (getattr(_module, _prefix + "Model"), getattr(_module, _prefix + "ForCausalLM"))
    test_pruning = False
    test_head_masking = False

    def setUp(self):
        self.model_tester = Tester(self)
"""


def sources(version: str) -> Path:
    """The two common-test files of transformers `version`, with stub mixins, as a package directory."""
    package = CACHE / version / "hf_tests"
    if (package / "test_modeling_common.py").exists():
        return package
    download = Path(tempfile.mkdtemp())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"transformers=={version}",
            "-d",
            str(download),
        ],
        check=True,
    )
    (archive,) = download.glob("transformers-*.tar.gz")
    package.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for name in ("test_modeling_common.py", "test_configuration_common.py"):
            member = tar.getmember(f"transformers-{version}/tests/{name}")
            (package / name).write_bytes(tar.extractfile(member).read())
    for stub, cls in (("exporters", "ExportTesterMixin"), ("generation", "GenerationTesterMixin")):
        (package / stub).mkdir(exist_ok=True)
        (package / stub / "__init__.py").write_text("")
        (
            package / stub / "test_export.py" if stub == "exporters" else package / stub / "test_utils.py"
        ).write_text(f"class {cls}:  # not shipped in the sdist; its tests are not run\n    pass\n")
    (package / "__init__.py").write_text("")
    shutil.rmtree(download)
    return package


def _prefix(model_type: str) -> str:
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"])
    (name,) = [
        n[: -len("ForCausalLM")] for n in vars(module) if n.endswith("ForCausalLM") and not n.startswith("_")
    ]
    return name


def run(family: str, bundle: str | None, mode: str, package: Path, workdir: Path) -> dict[str, str]:
    """{test id: outcome} of one family's common tests under `bundle` (None: stock) in `mode`."""
    directory = workdir / "hf_tests"
    if not directory.exists():
        shutil.copytree(package, directory)
        (directory / "conftest.py").write_text(_CONFTEST)
    test_file = directory / f"test_common_{family}.py"
    test_file.write_text(_TESTER.format(model_type=family, prefix=_prefix(family)))
    report = workdir / f"{family}-{bundle or 'stock'}-{mode}.json"
    env = {**os.environ, "LAYERSWAP_COMMON_BUNDLE": bundle or "", "LAYERSWAP_COMMON_MODE": mode}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-c",
            os.devnull,
            "--rootdir",
            str(workdir),
            "-o",
            "filterwarnings=ignore",
            f"--junitxml={report.with_suffix('.xml')}",
            str(test_file),
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return _outcomes(report.with_suffix(".xml"))


def _outcomes(junit: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            outcomes[name] = (
                "failed: " + (node.get("message") or "").splitlines()[0][:160]
                if node.get("message")
                else "failed"
            )
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def documented() -> set[tuple[str, str, str]]:
    """(test, purpose, family) of every outcome docs/troubleshooting.md's table explains, for the `construct`
    mode. A row's families cell is a list of families or "all four"; its bundles cell a list of `-purpose`."""
    text = TROUBLESHOOTING.read_text()
    section = text[text.index(_TABLE_HEADING) :]
    explained = set()
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`test_"):
            continue
        test, bundles, families, _why = cells
        purposes = [b.strip().strip("`").removeprefix("-") for b in bundles.split(",")]
        named = FAMILIES if families == "all four" else [f.strip() for f in families.split(",")]
        explained |= {(test.strip("`"), p, f) for p in purposes for f in named}
    return explained


def undocumented(family: str, purpose: str, differs: dict[str, str]) -> dict[str, str]:
    """The outcomes in `differs` (a `construct` run of `<family>-<purpose>`) the docs' table does not explain. A
    row names a test method; parameterized cases add a suffix (`test_x_0_fp16`)."""
    tests = {test for test, p, f in documented() if (p, f) == (purpose, family)}
    return {
        t: o for t, o in differs.items() if not any(t == test or t.startswith(f"{test}_") for test in tests)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--bundles", nargs="+", default=list(PURPOSES), help="purposes")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=Path("hf_common_tests.json"))
    args = parser.parse_args(argv)
    import layerswap

    package = sources(transformers.__version__)
    workdir = Path(tempfile.mkdtemp(prefix="layerswap-hf-common-"))
    results: dict[str, dict[str, dict[str, str]]] = {}
    unexplained_total = 0
    for family in args.families:
        start = time.time()
        stock = run(family, None, "plain", package, workdir)
        results[f"{family} stock"] = {"": stock}
        print(
            f"{family} stock: {sum(v == 'passed' for v in stock.values())} passed, "
            f"{sum(v.startswith('failed') for v in stock.values())} failed ({time.time() - start:.0f} s)",
            flush=True,
        )
        names = {b.name for b in layerswap.list_bundles()}
        for purpose in args.bundles:
            bundle = f"{family}-{purpose}"
            if bundle not in names:
                continue
            for mode in args.modes:
                start = time.time()
                outcomes = run(family, bundle, mode, package, workdir)
                differs = {t: o for t, o in outcomes.items() if o != stock.get(t)}
                results.setdefault(f"{family} stock", {})[f"{bundle} {mode}"] = differs
                print(
                    f"{bundle} {mode}: {len(differs)} outcome(s) differ from stock ({time.time() - start:.0f} s)",
                    flush=True,
                )
                unexplained = undocumented(family, purpose, differs) if mode == "construct" else {}
                unexplained_total += len(unexplained)
                for test, outcome in sorted(differs.items()):
                    flag = "  (not in docs/troubleshooting.md's table)" if test in unexplained else ""
                    print(f"    {test}: {stock.get(test)} -> {outcome}{flag}", flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    if unexplained_total:
        print(
            f"{unexplained_total} outcome(s) inside apply_bundles() differ from stock without a reason in the docs"
        )
    return 1 if unexplained_total else 0


if __name__ == "__main__":
    sys.exit(main())
