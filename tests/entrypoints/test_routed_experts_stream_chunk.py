"""Streaming responses carry each choice's rows on its final chunk (patch
`return-routed-experts-rows-in-the-final-stream-chunk`): the helper both streaming
generators call, on the real stream-choice models, serialised the way they are
(`model_dump_json(exclude_unset=True)`). The rows are decoded as a client decodes
them, by the fork's client decoder (`vllm.entrypoints.routed_experts`, numpy's own
.npy reader underneath), not by anything of the encoder's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm import CompletionOutput
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.generate.base.serving import GenerateBaseServing
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
)
from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice
from vllm.entrypoints.routed_experts import decode_routed_experts

ROWS = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)  # position p: 4p..4p+3


def output(rows: np.ndarray | None, start: int | None) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text="x",
        token_ids=[7],
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length",
        routed_experts=rows,
        routed_experts_start=start,
    )


def choices() -> list:
    return [
        CompletionResponseStreamChoice(index=0, text="x", finish_reason="length"),
        ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(content="x"), finish_reason="length"
        ),
    ]


@pytest.mark.parametrize("choice", choices())
def test_the_final_chunk_carries_the_rows_and_their_start(choice) -> None:
    GenerateBaseServing._attach_routed_experts(choice, output(ROWS, 3))
    sent = json.loads(choice.model_dump_json(exclude_unset=True))
    assert sent["routed_experts_start"] == 3
    decoded = decode_routed_experts(sent)
    assert decoded.start == 3
    rows = decoded.rows
    np.testing.assert_array_equal(rows, ROWS)
    assert rows.dtype == np.uint8


@pytest.mark.parametrize("choice", choices())
def test_a_choice_without_rows_sends_no_fields(choice) -> None:
    GenerateBaseServing._attach_routed_experts(choice, output(None, None))
    sent = json.loads(choice.model_dump_json(exclude_unset=True))
    assert "routed_experts" not in sent and "routed_experts_start" not in sent
