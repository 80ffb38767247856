"""Routed-experts chunks carry their absolute start (patch
`return-the-absolute-start-position-of-routed-experts`).

The engine sends a chunk's start only where the chunk does not continue the
request's previous one; the output processor continues the others from the
previous end. A start that is not that end fails that one request: its
generate() task raises, the engine is asked to abort it, and every other
request of the step gets its output."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.exceptions import GenerationError
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
)

SHAPE_PER_TOKEN = (2, 2)


def _state() -> RequestState:
    state = object.__new__(RequestState)
    state.request_id = "req-0-int"
    state.external_req_id = "req-0"
    state.routed_experts_chunks = []
    state.routed_experts_start = None
    state.routed_experts_end = None
    return state


def _rows(n: int, value: int = 0) -> np.ndarray:
    return np.full((n, *SHAPE_PER_TOKEN), value, dtype=np.uint8)


def test_chunks_that_tile_positions_keep_the_first_start() -> None:
    state = _state()
    assert state.add_routed_experts(_rows(5), 3) is None  # prefill chunk [3, 8)
    assert state.add_routed_experts(_rows(1), 8) is None  # continues: accepted
    assert state.add_routed_experts(_rows(1), None) is None  # decode: no start
    assert state.add_routed_experts(_rows(2), None) is None
    assert state.routed_experts_start == 3
    assert state.routed_experts_end == 3 + 5 + 1 + 1 + 2
    assert sum(len(c) for c in state.routed_experts_chunks) == 9


@pytest.mark.parametrize(("second_start", "kind"), [(9, "gap"), (7, "overlap")])
def test_a_gap_or_overlap_is_refused_and_drops_the_rows(
    second_start: int, kind: str
) -> None:
    state = _state()
    state.add_routed_experts(_rows(5), 3)
    error = state.add_routed_experts(_rows(1), second_start)
    assert error == (
        f"routed experts of request req-0 are not contiguous: chunk starts at "
        f"{second_start}, expected 8"
    ), kind
    # Nothing mislabelled is kept for a final output.
    assert state.routed_experts_chunks == []


def test_a_start_after_chunks_without_one_is_checked_against_their_end() -> None:
    state = _state()
    state.add_routed_experts(_rows(4), 0)
    state.add_routed_experts(_rows(1), None)
    state.add_routed_experts(_rows(1), None)  # [0, 6)
    assert state.add_routed_experts(_rows(1), 6) is None  # continues
    error = state.add_routed_experts(_rows(1), 5)
    assert error is not None and error.endswith("chunk starts at 5, expected 7")


def test_rows_without_any_start_stay_unlabelled() -> None:
    # An engine that sends no start (routed experts from an older engine core):
    # the rows are kept and no start is made up.
    state = _state()
    state.add_routed_experts(_rows(3), None)
    state.add_routed_experts(_rows(1), None)
    assert state.routed_experts_start is None and state.routed_experts_end is None
    assert sum(len(c) for c in state.routed_experts_chunks) == 4


def _add_request(
    processor: OutputProcessor, name: str, queue: RequestOutputCollector | None
) -> None:
    request = EngineCoreRequest(
        request_id=f"{name}-int",
        external_req_id=name,
        prompt_token_ids=[1, 2, 3, 4],
        mm_features=None,
        arrival_time=0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        sampling_params=SamplingParams(
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        ),
        pooling_params=None,
    )
    processor.add_request(request, prompt=None, queue=queue)


def _step(processor: OutputProcessor, outputs: dict[str, tuple]) -> list[str]:
    """One engine step: request name -> (token, rows, start, finished)."""
    processed = processor.process_outputs(
        [
            EngineCoreOutput(
                request_id=f"{name}-int",
                new_token_ids=[token],
                routed_experts=rows,
                routed_experts_start=start,
                finish_reason=FinishReason.LENGTH if finished else None,
            )
            for name, (token, rows, start, finished) in outputs.items()
        ]
    )
    return processed.reqs_to_abort


def test_a_gap_fails_only_its_request_in_the_async_engine() -> None:
    processor = OutputProcessor(tokenizer=None, log_stats=False)
    queues = {
        name: RequestOutputCollector(RequestOutputKind.FINAL_ONLY, f"{name}-int")
        for name in ("good", "bad")
    }
    for name, queue in queues.items():
        _add_request(processor, name, queue)

    # Prefill chunks [0, 4) for both; then "bad" gets a chunk at 6 (a gap).
    assert _step(processor, {n: (7, _rows(4, 1), 0, False) for n in queues}) == []
    aborted = _step(
        processor,
        {"good": (8, _rows(1, 2), None, False), "bad": (8, _rows(1, 2), 6, False)},
    )

    # The failed request is aborted in the engine core, which still runs it.
    assert aborted == ["bad-int"]
    with pytest.raises(GenerationError, match="chunk starts at 6, expected 4"):
        queues["bad"].get_nowait()
    assert "bad-int" not in processor.request_states

    # The other request goes on and ends with its complete, contiguous rows.
    assert _step(processor, {"good": (9, _rows(1, 3), None, True)}) == []
    output = queues["good"].get_nowait()
    assert output is not None and output.finished
    completion = output.outputs[0]
    assert completion.token_ids == [7, 8, 9]
    assert completion.routed_experts_start == 0
    assert completion.routed_experts[:, 0, 0].tolist() == [1, 1, 1, 1, 2, 3]
    assert processor.get_num_unfinished_requests() == 0


def test_a_gap_finishes_its_request_as_errored_without_rows_in_llm_engine() -> None:
    processor = OutputProcessor(tokenizer=None, log_stats=False)
    _add_request(processor, "bad", queue=None)
    _step(processor, {"bad": (7, _rows(4, 1), 0, False)})
    processed = processor.process_outputs(
        [
            EngineCoreOutput(
                request_id="bad-int",
                new_token_ids=[8],
                routed_experts=_rows(1, 2),
                routed_experts_start=2,  # an overlap
            )
        ]
    )
    assert processed.reqs_to_abort == ["bad-int"]
    (output,) = processed.request_outputs
    completion = output.outputs[0]
    assert output.finished and completion.finish_reason == "error"
    assert completion.routed_experts is None
    assert completion.routed_experts_start is None
    assert processor.get_num_unfinished_requests() == 0
