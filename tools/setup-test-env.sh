#!/usr/bin/env bash
# Create (or refresh) the test venv: CPU torch, the CPU-base fork wheel, test deps, NIXL.
#
#   tools/setup-test-env.sh            # venv at .venv (override: VENV=path)
#
# Idempotent: dependencies are installed once per (pins.toml, requirements) and
# recorded in a stamp file; the fork wheel is rebuilt (the base wheel is cached)
# and reinstalled without dependencies every run, so the venv always runs the
# series as committed. Nothing here may pull a CUDA build of torch: torch is
# pinned to 2.13.0 in every install (the CPU build lies on local disk), and
# NIXL's CUDA-flavoured package is installed without its dependencies.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
DIST=$ROOT/dist/cpu

log() { printf 'setup-test-env: %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=(pip_quiet "$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip config names local indexes that do not exist for every
# package; pip warns once per package. Drop that line, keep everything else.
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:///opt/" >&2); }

log "building the CPU-base fork wheel (pip wheel . with VLLM_FORK_BASE=cpu)"
rm -rf "$DIST"
mkdir -p "$DIST"
VLLM_FORK_BASE=cpu "${PIP[@]}" wheel "$ROOT" --no-deps -w "$DIST" -q
WHEEL=$(ls "$DIST"/vllm-*.whl)
log "built $(basename "$WHEEL")"

STAMP=$VENV/.fork-deps-stamp
WANT=$(cat "$ROOT/pins.toml" "$ROOT/requirements/test.txt" "$0" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    log "installing dependencies (first run: several minutes)"
    "${PIP[@]}" install -q "$TORCH" "$WHEEL" -r "$ROOT/requirements/test.txt"
    # PyPI's builds of these are CUDA-linked; beside CPU torch they break `import transformers`.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
    # nixl-cu12 declares an unpinned torch: --no-deps keeps the CPU build.
    "${PIP[@]}" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    echo "$WANT" > "$STAMP"
fi

log "installing $(basename "$WHEEL") (no deps)"
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL"

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
print(f"setup-test-env: ok: torch {torch.__version__}, vllm {md.version('vllm')}")
PY
