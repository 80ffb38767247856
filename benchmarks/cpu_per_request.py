#!/usr/bin/env python3
"""CPU time per request with routed experts on and off, side by side in one run.

    .venv/bin/python -m benchmarks.cpu_per_request [--preset qwen3-30b-a3b]
        [--prompt-tokens 1024] [--completion-tokens 64] [--requests 8] [--rounds 5]

Two colocated CPU servers of the same checkpoint (tools/testbed/tiny_moe.py, a
preset gives it a real model's routing shape), one with
--enable-return-routed-experts, one without. Each round sends both the same fixed
request set, one request at a time, in the same order (the variants alternate
which goes first: benchmarks/measure.py). Measured per round and variant:

- server CPU: user + system seconds of the server's whole process tree (API
  server, engine core, workers) over the request set (benchmarks/cpu_meter.py);
- client CPU: this process's CPU for the HTTP calls and, with rows, decoding them
  with the fork's client decoder (vllm.entrypoints.routed_experts);
- wall clock, as a secondary column: on a shared machine it measures the load.

It prints each round, then the median and the spread ((max - min) / median) of
every column over the rounds, the on / off ratios, and what a returned row costs:
(CPU on - CPU off) / rows returned, in microseconds. Nothing is asserted; numbers
go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cpu_meter import CpuMeter
from benchmarks.measure import Result, add_json_option, ratios, run_rounds, spend, spread
from benchmarks.request_set import prompts
from tools.testbed.cpu_server import VllmServer, choice_rows
from tools.testbed.tiny_moe import PRESETS, build

VARIANTS = ("on", "off")


@dataclass(frozen=True)
class RoundResult:
    server_cpu: float  # seconds over the request set
    client_cpu: float
    wall: float
    rows: int  # routed-experts rows returned
    by_process: dict[str, float]  # server CPU seconds by process name


def run_round(server: VllmServer, requests: list[list[int]], completion: int,
              round_index: int) -> RoundResult:
    assert server.process is not None

    def send() -> int:
        rows = 0
        for prompt in requests:
            # Salted per round so that no request finds another round's prefix cached.
            body = {"model": server.served_name, "prompt": [4 + round_index] + prompt,
                    "max_tokens": completion, "ignore_eos": True, "temperature": 0,
                    "return_token_ids": True}
            response = server.complete(body, timeout=1800)
            decoded = choice_rows(response["choices"][0], response=response)
            rows += 0 if decoded is None else len(decoded)
        return rows

    spent, rows = spend(send, CpuMeter({"server": server.process.pid}))
    assert spent.cpu is not None
    return RoundResult(spent.cpu.total, spent.own_cpu, spent.wall, rows,
                       spent.cpu.by_process)


def median_spread(values: list[float], fmt: str) -> str:
    """``median (spread)`` of per-round values."""
    return spread(values).format(fmt)


def print_summary(results: dict[str, list[RoundResult]], n: int) -> dict[str, float]:
    """Medians and spreads over the rounds, per variant and per server process;
    the on / off ratio and the CPU per returned row, on - off (returned as the
    headline ratios). `n`: requests per round."""
    print("\nover the rounds: median (spread)")
    for variant in VARIANTS:
        rounds = results[variant]
        print(f"{variant:>4}: "
              f"server CPU {median_spread([r.server_cpu / n for r in rounds], '.3f')} s/req, "
              f"client CPU {median_spread([r.client_cpu / n for r in rounds], '.4f')} s/req, "
              f"wall {median_spread([r.wall / n for r in rounds], '.3f')} s/req")
    print("server CPU by process, median s/req (spread):")
    names = sorted({name for r in results["on"] + results["off"] for name in r.by_process})
    for name in names:
        cells = []
        for variant in VARIANTS:
            values = [r.by_process.get(name, 0.0) / n for r in results[variant]]
            used = statistics.median(values) > 0
            cells.append(f"{variant} {median_spread(values, '.3f') if used else 0}")
        print(f"  {name:28} " + ", ".join(cells))
    pairs = list(zip(results["on"], results["off"]))
    ratio = ratios([on.server_cpu for on, _ in pairs], [off.server_cpu for _, off in pairs])
    per_row = spread(((on.server_cpu + on.client_cpu) - (off.server_cpu + off.client_cpu))
                     / max(on.rows, 1) * 1e6 for on, off in pairs)
    rows = statistics.median(r.rows for r in results["on"])
    print(f"server CPU on / off: median {ratio.median:.4f} "
          f"(rounds {ratio.low:.4f}-{ratio.high:.4f})")
    print(f"server + client CPU per returned row, on - off: median "
          f"{per_row.median:.1f} us (rounds {per_row.low:.1f} to "
          f"{per_row.high:.1f}; {rows / n:.0f} rows per request)")
    return {"server CPU on / off": ratio.median, "CPU per returned row us": per_row.median}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="routing shape (default: the served 2-layer fixture)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    add_json_option(parser)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cpu-per-request-"))
    model = workdir / "model"
    max_len = args.prompt_tokens + args.completion_tokens + 8
    build(model, num_experts=8, num_experts_per_tok=2, seed=0, preset=args.preset,
          max_model_len=max(max_len, 1024))
    sizes = ("--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len))
    servers = {
        variant: VllmServer(
            model=model, log_path=workdir / f"server-{variant}.log",
            extra_args=(*sizes, *(("--enable-return-routed-experts",)
                                  if variant == "on" else ())))
        for variant in VARIANTS
    }
    requests = prompts(args.requests, args.prompt_tokens)
    n = args.requests
    print(f"preset {args.preset or 'tiny fixture'}, {args.requests} requests x "
          f"{args.prompt_tokens} prompt + {args.completion_tokens} completion tokens, "
          f"one at a time, {args.rounds} rounds; work dir {workdir}", flush=True)
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(timeout=900)
        for variant, server in servers.items():  # warm-up, not measured
            run_round(server, requests[:1], args.completion_tokens, -1)
        print(f"{'round':>5} {'variant':>7} {'server CPU s/req':>17} "
              f"{'client CPU s/req':>17} {'wall s/req':>11} {'rows/req':>9}")

        def one_round(variant: str, round_index: int) -> RoundResult:
            result = run_round(servers[variant], requests, args.completion_tokens,
                               round_index)
            print(f"{round_index:5d} {variant:>7} {result.server_cpu / n:17.3f} "
                  f"{result.client_cpu / n:17.4f} {result.wall / n:11.3f} "
                  f"{result.rows / n:9.0f}", flush=True)
            return result

        results = run_rounds(VARIANTS, args.rounds, one_round)
    finally:
        for server in servers.values():
            server.stop()

    headline = print_summary(results, n)
    Result("benchmarks.cpu_per_request", vars(args),
           {variant: [vars(r) for r in rounds] for variant, rounds in results.items()},
           headline).emit(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
