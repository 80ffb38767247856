#!/usr/bin/env python3
"""What `return_routed_experts: false` saves per request (patch
let-a-request-skip-or-require-its-routed-experts): bytes and serialisation time of
one finished request's response, with its routed-experts rows vs without them, for the
served tiny model and two production shapes.

    .venv/bin/python -m benchmarks.routed_experts_opt_out [--rounds 15]

Both hops a request's rows take are measured with vLLM's own code, side by side in
one run:

- engine core -> API server: one `EngineCoreOutputs` holding the request's
  `EngineCoreOutput`, encoded with vLLM's `MsgpackEncoder` (the rows arrive over the
  steps of the request; the total is the same);
- API server -> client: `numpy2base64` of the rows and the `CompletionResponse` JSON
  (`model_dump_json`), as `/v1/completions` builds it.

"off" is the same request with `routed_experts=None`, which is what the scheduler
sends for a request that opted out. On and off alternate round by round
(benchmarks/measure.py); times are the fastest of the rounds; nothing is asserted
(numbers go to benchmarks/README.md).
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.block_bytes import PRODUCTION, Shape, tiny_shape
from benchmarks.measure import Result, add_json_option, run_rounds, spread, timed
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.utils.serial_utils import numpy2base64
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackEncoder

LENGTHS = (1024, 8192, 32768)  # prompt + completion tokens
OUTPUT_TOKENS = 256


def measure(shape: Shape, length: int, rounds: int) -> dict[str, float]:
    dtype = np.uint8 if shape.num_experts <= 256 else np.uint16
    rng = np.random.default_rng(0)
    rows = rng.integers(0, shape.num_experts, (length - 1, shape.layers, shape.top_k))
    rows = rows.astype(dtype)
    tokens = [int(t) for t in rng.integers(0, 50_000, OUTPUT_TOKENS)]
    encoder = MsgpackEncoder()

    def ipc(with_rows: bool) -> int:
        output = EngineCoreOutput(request_id="r", new_token_ids=tokens,
                                  routed_experts=rows if with_rows else None)
        return sum(memoryview(b).nbytes for b in
                   encoder.encode(EngineCoreOutputs(outputs=[output])))

    def response(with_rows: bool) -> int:
        choice = CompletionResponseChoice(
            index=0, text="x" * OUTPUT_TOKENS, logprobs=None, finish_reason="length",
            routed_experts=numpy2base64(rows) if with_rows else None,
            routed_experts_start=0 if with_rows else None)
        body = CompletionResponse(
            model="m", choices=[choice],
            usage=UsageInfo(prompt_tokens=length - OUTPUT_TOKENS,
                            completion_tokens=OUTPUT_TOKENS, total_tokens=length))
        return len(body.model_dump_json())

    out: dict[str, float] = {}
    for hop, fn in (("ipc", ipc), ("http", response)):
        timings = run_rounds((True, False), rounds,
                             lambda with_rows, _, f=fn: timed(lambda: f(with_rows)))
        for with_rows, rounds_of in timings.items():
            key = f"{hop}_{'on' if with_rows else 'off'}"
            out[f"{key}_us"] = spread(seconds for seconds, _ in rounds_of).low * 1e6
            out[f"{key}_bytes"] = float(rounds_of[-1][1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    add_json_option(parser)
    args = parser.parse_args(argv)
    figures: dict[str, dict[str, float]] = {}
    print(f"{'shape':28} {'tokens':>6} {'IPC bytes on/off':>22} {'IPC us on/off':>16} "
          f"{'HTTP bytes on/off':>24} {'HTTP us on/off':>17}")
    for shape in (tiny_shape(), *PRODUCTION):
        for length in LENGTHS:
            r = figures[f"{shape.name} {length}"] = measure(shape, length, args.rounds)
            print(f"{shape.name:28} {length:6d} "
                  f"{r['ipc_on_bytes']:11,.0f}/{r['ipc_off_bytes']:<10,.0f} "
                  f"{r['ipc_on_us']:8.0f}/{r['ipc_off_us']:<7.0f} "
                  f"{r['http_on_bytes']:12,.0f}/{r['http_off_bytes']:<11,.0f} "
                  f"{r['http_on_us']:9.0f}/{r['http_off_us']:<7.0f}")
    print(f"one finished request of N tokens ({OUTPUT_TOKENS} generated), rows from 0; "
          f"fastest of {args.rounds} rounds; off = return_routed_experts: false")
    Result("benchmarks.routed_experts_opt_out", vars(args), figures,
           {f"{key}: HTTP bytes on / off": r["http_on_bytes"] / r["http_off_bytes"]
            for key, r in figures.items()}).emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
