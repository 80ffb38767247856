"""A request whose routed-experts rows could not be read gets an error naming the
positions, the cause and what the client can do (patch
fail-one-request-not-the-engine-when-its-routed): the scheduler sends it with
the request's EngineCoreOutput, and the OutputProcessor raises it in the
request's stream. The scheduler's message is checked in
tests/v1/core/test_routed_experts_unavailable.py."""

from __future__ import annotations

import pytest

from tests.v1.request_error_utils import REQUEST_ID, stream_after_error_output
from vllm.exceptions import GenerationError
from vllm.outputs import RequestError

MESSAGE = (
    "This request was stopped rather than answered with incomplete routed-experts "
    "rows: its routed-experts rows of positions [0, 11) could not be read "
    "(BlockObjectStoreError: no rows for block 3). Retry the request, or set "
    "return_routed_experts to false if it does not need them."
)


def test_the_stream_raises_the_message() -> None:
    processor, stream = stream_after_error_output(
        RequestError(code="routed_experts_unavailable", message=MESSAGE)
    )
    with pytest.raises(GenerationError, match=r"^This request was stopped") as error:
        stream.get_nowait()
    assert str(error.value) == MESSAGE
    assert not processor.has_request(REQUEST_ID)
