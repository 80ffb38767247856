#!/usr/bin/env bash
# Create a venv with the fork wheel and Ray Serve LLM 2.60.0 beside it, for
# tests/v1/kv_connector/test_ray_serve_pd_e2e.py and `python -m
# tools.testbed.ray_serve_pd` (docs/deployments/ray-serve.md).
#
#   tools/setup-ray-serve-env.sh         # venv at .venv-ray (override: VENV=path)
#   FORK_WHEEL=dist/cpu/vllm-...whl tools/setup-ray-serve-env.sh
#
# It installs an already built CPU fork wheel (make venv or make wheel-cpu builds
# one; default: the single one in dist/cpu/, else in dist/) and does not build it. `ray[llm]==2.60.0` cannot be
# used: its `llm` extra pins vllm[audio]==0.29.0 and nixl==1.3.2. Instead Ray's
# `serve` extra and the `llm` extra's other requirements (requirements/ray-serve.txt)
# are installed with every package already in the venv as a constraint, so pip
# adds packages and never replaces the fork or its dependencies.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv-ray}
PY=${PYTHON:-python3}
log() { printf 'setup-ray-serve-env: %s\n' "$*" >&2; }

if [ -z "${FORK_WHEEL:-}" ]; then
    # dist/cpu/ is where make venv (tools/setup-test-env.sh) builds it, dist/ where
    # make wheel-cpu does; the first directory holding exactly one wins.
    shopt -s nullglob
    for dir in "$ROOT/dist/cpu" "$ROOT/dist"; do
        wheels=("$dir"/vllm-*.cpu-*.whl)
        if [ ${#wheels[@]} -eq 1 ]; then FORK_WHEEL=${wheels[0]}; break; fi
        if [ ${#wheels[@]} -gt 1 ]; then
            log "${#wheels[@]} CPU fork wheels in $dir: set FORK_WHEEL to the one to install"
            exit 1
        fi
    done
    if [ -z "${FORK_WHEEL:-}" ]; then
        log "no CPU fork wheel in dist/cpu/ or dist/: run make venv or make wheel-cpu, or set FORK_WHEEL"
        exit 1
    fi
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:///opt/" >&2); }
PIP=(pip_quiet "$VENV/bin/python" -m pip --disable-pip-version-check)

log "installing CPU torch and $(basename "$FORK_WHEEL")"
"${PIP[@]}" install -q torch==2.13.0 "$FORK_WHEEL"
# PyPI's builds of these are CUDA-linked; beside CPU torch they break `import transformers`.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true

CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^ray[=@ ]' > "$CONSTRAINTS"
log "installing Ray Serve 2.60.0 (requirements/ray-serve.txt) without replacing anything"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -r "$ROOT/requirements/ray-serve.txt"
# The fork's NIXL (nixl-cu12 declares an unpinned torch: --no-deps keeps the CPU build).
"${PIP[@]}" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.version.cuda is None, f"a CUDA torch crept in: {torch.__version__}"
vllm = md.version("vllm")
assert "+r3" in vllm and vllm.endswith(".cpu"), f"not the CPU fork wheel: vllm {vllm}"
assert md.version("ray") == "2.60.0", md.version("ray")
from ray.serve.llm import build_pd_openai_app  # noqa: F401  Ray's P/D app imports
print(f"setup-ray-serve-env: vllm {vllm}, ray {md.version('ray')}, nixl {md.version('nixl')}")
PY
