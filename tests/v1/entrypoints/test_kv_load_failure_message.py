"""A request that failed because its KV could not be loaded gets an error that
names the cause, the policy and the fix (patch
say-why-a-request-failed-when-its-kv-could-not-be): the scheduler sends it with
the request's EngineCoreOutput (error=RequestError), and the API server's
OutputProcessor raises it in the request's stream, which every endpoint reads."""

from __future__ import annotations

import pytest

from tests.v1.request_error_utils import (
    REQUEST_ID,
    finished_output,
    stream_after_error_output,
)
from vllm.exceptions import GenerationError
from vllm.outputs import RequestError

MESSAGE = (
    "The KV cache of this request could not be loaded: the NIXL READ of its KV "
    "failed. kv_transfer_config.kv_load_failure_policy is 'fail': retry the "
    "request, or set kv_load_failure_policy to 'recompute' to compute the prompt "
    "locally."
)


def test_the_stream_raises_the_error_and_the_request_ends() -> None:
    processor, stream = stream_after_error_output(
        RequestError(code="kv_load_failed", message=MESSAGE)
    )
    with pytest.raises(GenerationError) as error:
        stream.get_nowait()
    assert str(error.value) == MESSAGE
    assert error.value.status_code == 500
    assert not processor.has_request(REQUEST_ID)


def test_an_error_output_without_an_error_keeps_the_generic_path() -> None:
    """Negative control: without EngineCoreOutput.error the stream gets the
    finished output (finish_reason "error"), which the endpoints answer with
    upstream's generic "Internal server error"."""
    _, stream = stream_after_error_output(None)
    output = finished_output(stream)
    assert output.finished
    assert output.outputs[0].finish_reason == "error"
