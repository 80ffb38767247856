"""`--async-scheduling` on the CPU platform (patch
`honour-async-scheduling-on-the-cpu-platform`).

vLLM 0.31.0's CPU platform set `scheduler_config.async_scheduling = False` after the
config had resolved it, so an explicit `--async-scheduling` was accepted and silently
dropped. Expected values come from the documented flag: unset keeps CPU's default
(off), False is off, True is on. On a real VllmConfig built for CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.config import DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.platforms import current_platform

pytestmark = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="the CPU platform's config rules"
)


def resolved(model_dir: Path, async_scheduling: bool | None) -> bool | None:
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=512,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        device_config=DeviceConfig("cpu"),
    )
    return config.scheduler_config.async_scheduling


@pytest.mark.parametrize(
    ("flag", "expected"), [(None, False), (False, False), (True, True)]
)
def test_the_flag_decides_on_cpu(model_dir: Path, flag, expected) -> None:
    assert resolved(model_dir, flag) is expected


@pytest.mark.parametrize(("flag", "logged"), [(True, 1), (None, 0), (False, 0)])
def test_an_honoured_request_is_logged(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, flag, logged: int
) -> None:
    """A server log says async scheduling is on when it is (CPU's default is off)."""
    import vllm.config.vllm as vllm_config_module

    said: list[str] = []
    monkeypatch.setattr(
        vllm_config_module.logger,
        "info",
        lambda msg, *args, **kw: said.append(msg % args),
    )
    resolved(model_dir, flag)
    assert [m for m in said if m.startswith("Asynchronous scheduling is on")] == [
        "Asynchronous scheduling is on, as requested (off by default on cpu)."
    ] * logged
