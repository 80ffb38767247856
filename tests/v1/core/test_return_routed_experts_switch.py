"""The per-request switch `return_routed_experts` (patch
`let-a-request-skip-or-require-its-routed-experts`).

None (default) keeps today's behaviour; False leaves the rows out of the request's
outputs (they are still captured and cached); True on a server without
--enable-return-routed-experts is refused naming the flag, and so is a
routed_experts_prompt_start there (unless the request opted out); a start that is not
an int is refused everywhere. Checked on a real Scheduler (two requests in the same
steps, one with each setting: the other is the negative control), on the input
processor's checks, and through the OpenAI request models.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.v1.aux_scheduler_utils import make_request, make_scheduler, step
from vllm.config import KVTransferConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

pytestmark = pytest.mark.usefixtures("scheduler_env")


def test_a_request_that_opts_out_gets_no_rows(model_dir: Path) -> None:
    scheduler = make_scheduler(
        model_dir,
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"),
    )
    wanted = make_request("wanted", list(range(4, 24)), max_tokens=3)
    skipped = make_request("skipped", list(range(4, 24)), max_tokens=3)
    skipped.sampling_params.return_routed_experts = False
    scheduler.add_request(wanted)
    scheduler.add_request(skipped)
    rows: dict[str, list] = {"wanted": [], "skipped": []}
    outputs_seen: dict[str, int] = {"wanted": 0, "skipped": 0}
    while scheduler.requests:
        _, emitted = step(scheduler)
        for output in emitted:
            outputs_seen[output.request_id] += 1
            if output.routed_experts is not None:
                rows[output.request_id].append(len(output.routed_experts))
    assert outputs_seen == {"wanted": 3, "skipped": 3}
    # Rows from 0 to P + C - 1 for the default request, 20 + 3 - 1 = 22 ...
    assert sum(rows["wanted"]) == 22
    # ... and none at all for the one that asked not to get them.
    assert rows["skipped"] == []


def processor(enabled: bool) -> InputProcessor:
    proc = object.__new__(InputProcessor)
    proc.vllm_config = SimpleNamespace(
        aux_output_config=SimpleNamespace(enabled=enabled)
    )
    return proc


def test_requiring_rows_from_a_server_without_them_names_the_flag() -> None:
    with pytest.raises(VLLMValidationError) as error:
        processor(False)._check_return_routed_experts(
            SamplingParams(return_routed_experts=True)
        )
    assert error.value.parameter == "return_routed_experts"
    assert "--enable-return-routed-experts" in str(error.value)
    # Everything else passes: default and opt-out anywhere, required with the flag.
    for enabled in (False, True):
        processor(enabled)._check_return_routed_experts(SamplingParams())
        processor(enabled)._check_return_routed_experts(
            SamplingParams(return_routed_experts=False)
        )
    processor(True)._check_return_routed_experts(
        SamplingParams(return_routed_experts=True)
    )


def test_a_prompt_start_without_the_flag_names_the_field_and_the_flag() -> None:
    """A start selects rows; without the flag it would be answered with none."""
    with pytest.raises(VLLMValidationError) as error:
        processor(False)._check_return_routed_experts(
            SamplingParams(routed_experts_prompt_start=5)
        )
    assert error.value.parameter == "routed_experts_prompt_start"
    assert error.value.value == 5
    assert "routed_experts_prompt_start=5" in str(error.value)
    assert "--enable-return-routed-experts" in str(error.value)
    # Negative controls: the same start with the flag, or with rows opted out.
    processor(True)._check_return_routed_experts(
        SamplingParams(routed_experts_prompt_start=5)
    )
    processor(False)._check_return_routed_experts(
        SamplingParams(routed_experts_prompt_start=5, return_routed_experts=False)
    )


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("start", [True, 2.0, "3"])
def test_a_prompt_start_that_is_not_an_int_is_refused(enabled: bool, start) -> None:
    """The generate endpoint builds SamplingParams itself: a JSON true must not be 1."""
    params = SamplingParams()
    params.routed_experts_prompt_start = start
    with pytest.raises(VLLMValidationError, match="must be an integer, got") as error:
        processor(enabled)._check_return_routed_experts(params)
    assert error.value.parameter == "routed_experts_prompt_start"


@pytest.mark.parametrize("start", [True, "3", 3.0])
def test_the_openai_requests_refuse_a_prompt_start_that_is_not_an_int(start) -> None:
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        CompletionRequest(
            model="m", prompt="hi", max_tokens=2, routed_experts_prompt_start=start
        )
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            routed_experts_prompt_start=start,
        )
    # Negative control: an int is accepted.
    assert (
        CompletionRequest(
            model="m", prompt="hi", routed_experts_prompt_start=3
        ).routed_experts_prompt_start
        == 3
    )


@pytest.mark.parametrize("value", [None, False, True])
def test_the_openai_requests_carry_the_switch(value: bool | None) -> None:
    extra = {} if value is None else {"return_routed_experts": value}
    completion = CompletionRequest(model="m", prompt="hi", max_tokens=2, **extra)
    assert completion.to_sampling_params(2048).return_routed_experts is value
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra
    )
    assert chat.to_sampling_params(2048, {}).return_routed_experts is value
