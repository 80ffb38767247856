"""The API server's error for a request whose KV could not be loaded names the
cause and the fix; any other engine error keeps upstream's generic message."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.exceptions import KV_LOAD_FAILED, GenerationError


def raise_if_error(finish_reason, stop_reason) -> None:
    serving = object.__new__(OpenAIServingCompletion)
    serving._raise_if_error(finish_reason, "cmpl-1", stop_reason)


def test_kv_load_failure_message_names_the_policy_and_the_fix() -> None:
    with pytest.raises(GenerationError) as error:
        raise_if_error("error", KV_LOAD_FAILED)
    message = str(error.value)
    assert "could not be loaded" in message
    assert "kv_transfer_config.kv_load_failure_policy is 'fail'" in message
    assert "'recompute'" in message
    assert error.value.status_code == 500


def test_other_errors_keep_the_generic_message() -> None:
    with pytest.raises(GenerationError, match="^Internal server error$"):
        raise_if_error("error", None)


@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
def test_no_error_no_exception(finish_reason) -> None:
    raise_if_error(finish_reason, KV_LOAD_FAILED)
