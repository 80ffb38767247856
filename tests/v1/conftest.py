"""Fixtures for scheduler tests with routed experts on.

tests/v1 is not a package (no __init__.py), so pytest imports this conftest by
putting tests/v1 on `sys.path` itself; that is what lets the test files under
tests/v1 import `aux_scheduler_utils` by module name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.testbed.tiny_moe import build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


@pytest.fixture
def scheduler_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What routed experts need of the process: Model Runner V2. Where the config
    checks that Model Runner V2 has Triton (vLLM 0.31.0), it sees it: on CPU
    Triton counts only with VLLM_CPU_TRITON_INTERPRET=1 at import, and these
    tests run no kernel."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr("vllm.config.vllm.HAS_TRITON", True, raising=False)
