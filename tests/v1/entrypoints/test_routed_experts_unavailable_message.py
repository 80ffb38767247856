"""The API server's error for a request whose routed-experts rows could not be
read names the cause and what the client can do (patch
`fail-one-request-when-its-routed-experts-rows-are`)."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.exceptions import (
    KV_LOAD_FAILED,
    ROUTED_EXPERTS_UNAVAILABLE,
    GenerationError,
)


def raise_if_error(finish_reason, stop_reason) -> None:
    serving = object.__new__(OpenAIServingCompletion)
    serving._raise_if_error(finish_reason, "cmpl-1", stop_reason)


def test_the_message_names_the_rows_and_the_opt_out() -> None:
    with pytest.raises(GenerationError) as error:
        raise_if_error("error", ROUTED_EXPERTS_UNAVAILABLE)
    message = str(error.value)
    assert "routed-experts rows of this request could not be read" in message
    assert "return_routed_experts" in message
    assert error.value.status_code == 500


def test_the_kv_load_message_is_another_one() -> None:
    """Negative control: each cause keeps its own message."""
    with pytest.raises(GenerationError) as error:
        raise_if_error("error", KV_LOAD_FAILED)
    assert "routed-experts" not in str(error.value)


@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
def test_no_error_no_exception(finish_reason) -> None:
    raise_if_error(finish_reason, ROUTED_EXPERTS_UNAVAILABLE)
