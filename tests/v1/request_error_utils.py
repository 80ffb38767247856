"""A request's error as its generate() task sees it: the OutputProcessor of the
API server given one EngineCoreOutput (the path every endpoint's stream reads)."""

from __future__ import annotations

from vllm.outputs import RequestError, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

REQUEST_ID = "request-0"


def stream_after_error_output(
    error: RequestError | None,
) -> tuple[OutputProcessor, RequestOutputCollector]:
    """Add one request, then process its error output (FinishReason.ERROR, with
    or without an error); return the processor and the request's stream."""
    processor = OutputProcessor(tokenizer=None, log_stats=False)
    request = EngineCoreRequest(
        request_id=REQUEST_ID,
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=SamplingParams(
            max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False
        ),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=REQUEST_ID,
    )
    stream = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, REQUEST_ID)
    processor.add_request(request, None, queue=stream)
    processor.process_outputs(
        [
            EngineCoreOutput(
                request_id=REQUEST_ID,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=error,
            )
        ]
    )
    return processor, stream


def finished_output(stream: RequestOutputCollector) -> RequestOutput:
    output = stream.get_nowait()
    assert isinstance(output, RequestOutput)
    return output
