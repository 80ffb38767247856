"""Fixtures for scheduler tests with routed experts on; makes aux_scheduler_utils.py
importable from every test directory under tests/v1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tiny_moe import build

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


@pytest.fixture
def scheduler_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build configs without MRV2; make_scheduler switches it on, and monkeypatch
    (which recorded the variable here) undoes that after the test."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
