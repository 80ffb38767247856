#!/usr/bin/env python3
"""An RL group under P/D: one request with n > 1 vs n separate requests, side by side.

    .venv/bin/python -m benchmarks.pd_group_sampling [--sizes 1 4 8] [--lengths 1024]
                                                     [--rounds 2]

One P/D pair of the installed fork on the harness's tiny MoE (its context raised to
fit the longest prompt), rows over NIXL on both roles, behind the stock vllm-router,
built by the equivalence harness's cluster (tools/e2e/cluster.py). For each group
size n and prompt length, each round sends a fresh prompt two ways, alternating which
goes first (benchmarks/measure.py), each with a prompt of its own (so neither hits the other's prefix cache):
one request with `n` (seeded sampling: vLLM seeds child i with seed + i), and `n`
requests of one prompt with n = 1 sent at once (what a trainer sends when n > 1 is
refused). Every choice must carry its rows from 0 (P + C - 1 of them), or the run
stops: a cheap wrong answer is not a measurement.

Measured per way, from the servers' own /metrics and /proc, summed over the rounds
after the first (a warm-up):
- NIXL transfers decode made (`vllm:nixl_xfer_time_seconds` count) and the bytes they
  read (`vllm:nixl_bytes_transferred` sum);
- prompt tokens prefill computed (`vllm:prompt_tokens` less `vllm:prompt_tokens_cached`)
  and prefill's engine steps (`vllm:iteration_tokens_total` count);
- the peak of decode's `vllm:kv_cache_usage_perc` while the way runs, as blocks;
- CPU seconds of the deployment (both engines, their API servers and the router;
  benchmarks/cpu_meter.py, NIXL's polling threads left out).

Reported: each figure for both ways and group / separate. Goals (issue 49): transfers
and bytes 1 / n, decode blocks = the prompt's blocks + n tails, CPU per group below
the separate requests' for n >= 4.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.entrypoints.routed_experts import decode_routed_experts

from benchmarks.cpu_meter import CpuMeter
from benchmarks.measure import Result, add_json_option, order, spend
from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import CPU_SERVE_ARGS, ClusterSpec
from tools.e2e.scenarios import BLOCK_SIZE, prompt_ids
from tools.testbed.cpu_server import post_json
from tools.testbed.metrics import read, total
from tools.testbed.spinners import spinning_threads
from tools.testbed.tiny_moe import build

MAX_TOKENS = 16
WAYS = ("group", "separate")
# (server, selector) -> the figure's name.
COUNTERS = {
    ("decode", "vllm:nixl_xfer_time_seconds_count"): "NIXL transfers",
    ("decode", "vllm:nixl_bytes_transferred_sum"): "NIXL bytes",
    ("prefill", "vllm:prompt_tokens_total"): "prefill prompt tokens",
    ("prefill", "vllm:prompt_tokens_cached_total"): "prefill cached tokens",
    ("prefill", "vllm:iteration_tokens_total_count"): "prefill steps",
}


@dataclass
class Figures:
    """One way's sums over the counted rounds."""

    counters: dict[str, float] = field(default_factory=dict)
    peak_blocks: float = 0.0
    cpu_seconds: float = 0.0

    def add(self, other: Figures) -> None:
        for name, value in other.counters.items():
            self.counters[name] = self.counters.get(name, 0.0) + value
        self.peak_blocks += other.peak_blocks
        self.cpu_seconds += other.cpu_seconds

    def row(self) -> dict[str, float]:
        counters = dict(self.counters)
        counters["prefill computed tokens"] = counters.pop(
            "prefill prompt tokens", 0.0) - counters.pop("prefill cached tokens", 0.0)
        return {**counters, "decode peak blocks": self.peak_blocks,
                "CPU seconds": self.cpu_seconds}


def build_model(workdir: Path, max_len: int) -> Path:
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0, max_model_len=max_len)
    return model


def _counters(cluster: Cluster) -> dict[str, float]:
    samples = {name: read(cluster.servers[name].url) for name in ("prefill", "decode")}
    return {label: total(samples[server], selector)
            for (server, selector), label in COUNTERS.items()}


class PeakUsage:
    """The highest vllm:kv_cache_usage_perc decode reports while it runs."""

    def __init__(self, url: str) -> None:
        self.url, self.peak = url, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, total(read(self.url), "vllm:kv_cache_usage_perc"))
            self._stop.wait(0.05)

    def __enter__(self) -> PeakUsage:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _check(response: tuple[int, dict[str, Any]], length: int, n: int) -> None:
    status, body = response
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {str(body)[:300]}")
    choices = body["choices"]
    if len(choices) != n:
        raise RuntimeError(f"{len(choices)} choices, expected {n}")
    for choice in choices:
        rows = decode_routed_experts(choice).rows
        want = length + len(choice["token_ids"]) - 1
        if choice.get("routed_experts_start") != 0 or len(rows) != want:
            raise RuntimeError(f"rows start at {choice.get('routed_experts_start')} with "
                               f"{len(rows)} rows; expected 0 and {want} (P + C - 1)")


def _body(prompt: list[int], n: int, seed: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "return_token_ids": True, "n": n,
            "seed": seed, "temperature": 0.8, "top_k": 5, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "routed_experts_prompt_start": 0}


def run_way(cluster: Cluster, meter: CpuMeter, num_blocks: int, way: str,
            prompt: list[int], n: int) -> Figures:
    def send() -> None:
        if way == "group":
            _check(post_json(cluster.url, "/v1/completions", _body(prompt, n, 7)),
                   len(prompt), n)
            return
        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(
                lambda i: post_json(cluster.url, "/v1/completions",
                                    _body(prompt, 1, 7 + i)), range(n)))
        for answer in answers:
            _check(answer, len(prompt), 1)

    before = _counters(cluster)
    with PeakUsage(cluster.servers["decode"].url) as usage:
        spent, _ = spend(send, meter)
    after = _counters(cluster)
    assert spent.cpu is not None
    return Figures({name: after[name] - before[name] for name in after},
                   usage.peak * num_blocks, spent.cpu.total)


def cell_prompt(n: int, length: int, lengths: list[int], round_index: int,
                way: str) -> list[int]:
    """A fresh prompt per cell, round and way, so that none finds another's blocks in
    a prefix cache. Prompts of one index share their leading tokens across lengths,
    so the length is part of the index too."""
    index = ((round_index * 100 + n) * 2 + WAYS.index(way)) * len(lengths)
    return prompt_ids(53, index + lengths.index(length), length)


def measure(cluster: Cluster, sizes: list[int], lengths: list[int],
            rounds: int) -> dict[tuple[int, int, str], Figures]:
    roots = {name: server.process.pid for name, server in cluster.servers.items()
             if server.process is not None}
    if cluster.proxy_process is not None:
        roots["router"] = cluster.proxy_process.pid
    meter = CpuMeter(roots, exclude=spinning_threads(roots.values()))
    num_blocks = _num_gpu_blocks(cluster.servers["decode"].url)
    results: dict[tuple[int, int, str], Figures] = {}
    for n in sizes:
        for length in lengths:
            for round_index in range(rounds + 1):
                for way in order(WAYS, round_index):
                    prompt = cell_prompt(n, length, lengths, round_index, way)
                    figures = run_way(cluster, meter, num_blocks, way, prompt, n)
                    if round_index:
                        results.setdefault((n, length, way), Figures()).add(figures)
                print(f"pd-group-sampling: n={n} P={length} round {round_index} done",
                      flush=True)
    return results


def _num_gpu_blocks(url: str) -> float:
    """decode's KV cache size in blocks, from vllm:cache_config_info's label."""
    for series in read(url):
        if series.name == "vllm:cache_config_info":
            value = dict(series.labels).get("num_gpu_blocks")
            if value and value != "None":
                return float(value)
    return 0.0


def report(results: dict[tuple[int, int, str], Figures], rounds: int) -> str:
    lines = [f"pd-group-sampling: sums over {rounds} counted round(s) per cell; "
             "ratio = group / separate", "",
             "| n | P | figure | group | separate | ratio |", "|---|---|---|---|---|---|"]
    for (n, length, way), figures in sorted(results.items()):
        if way != "group":
            continue
        group, separate = figures.row(), results[(n, length, "separate")].row()
        for name, value in group.items():
            other = separate[name]
            ratio = f"{value / other:.3f}" if other else "-"
            lines.append(f"| {n} | {length} | {name} | {value:.1f} | {other:.1f} | "
                         f"{ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_group_sampling",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8],
                        help="group sizes n (default: %(default)s)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024],
                        help="prompt lengths in tokens (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="counted rounds per cell, after one warm-up (default: "
                        "%(default)s)")
    parser.add_argument("--workdir", type=Path, help="model and logs (default: temp)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pd-group-sampling-"))
    max_len = max(args.lengths) + MAX_TOKENS + BLOCK_SIZE
    model = build_model(workdir, max_len)
    spec = ClusterSpec(model, routed_experts_transfer=True, router="vllm-router",
                       reference=False,
                       serve_args=(*CPU_SERVE_ARGS, "--max-model-len", str(max_len)))
    started = time.monotonic()
    with Cluster(spec, workdir / "logs") as cluster:
        results = measure(cluster, args.sizes, args.lengths, args.rounds)
    print(report(results, args.rounds))
    print(f"pd-group-sampling: {time.monotonic() - started:.0f} s, logs under {workdir}")
    rows = {f"n={n} P={length} {way}": figures.row()
            for (n, length, way), figures in sorted(results.items())}
    Result("benchmarks.pd_group_sampling", vars(args), rows,
           {f"n={n} P={length}: {name} group / separate": value / separate[name]
            for (n, length, way), figures in sorted(results.items()) if way == "group"
            for separate in [results[(n, length, "separate")].row()]
            for name, value in figures.row().items() if separate[name]}).emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
