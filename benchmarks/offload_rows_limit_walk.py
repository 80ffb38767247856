#!/usr/bin/env python3
"""What a waiting request's rows-aware offload limit costs per scheduler step.

    .venv/bin/python -m benchmarks.offload_rows_limit_walk [--tokens 4096 32768]
                                                           [--mode callgrind|wall]

With `enable_routed_experts_transfer` on the OffloadingConnector, the scheduler
asks `OffloadingConnectorScheduler.rows_load_limit` for every waiting request,
every step: how far a load may go before a chunk that holds a position whose rows
the request emits but has no rows. It walks the request's chunks; a waiting
request asks again each step. This measures one call on a real scheduler (the
native OffloadingConnector, the tiny MoE's config), for a prompt whose every
16-token chunk is offloaded with rows (reported through the index's own store
API: `store_started`, `rows_stored`, `job_finished`):

- first call: the walk from the request's first chunk (what every call cost
  before the walk resumed);
- next call: the walk resumed where the last one stopped (what each later step
  of the waiting request costs);
- after a chunk lost its rows: the walk starts over (correctness, not speed).

Instructions are counted by callgrind (deterministic) around the one call; `--mode
wall` times a first and a next call of `--calls` fresh waiting requests with the
same prompt instead (medians). One process per prompt length.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.measure import Result, add_json_option, spread, timed

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
CASES = ("first", "next", "after_loss")


def populate(scheduler: Any, request: Any) -> Any:
    """Every full chunk of `request` offloaded with its rows, as the output rank
    reports a store job of them; returns the rows index."""
    from vllm.v1.kv_offload.base import make_offload_key

    # The connector's scheduler-side rows index: what rows_load_limit reads.
    index = scheduler.connector.connector_scheduler._rows
    chunks = list(range(len(request.block_hashes)))
    keys = [make_offload_key(request.block_hashes[i], 0) for i in chunks]
    index.store_started(1, request.request_id, request.all_token_ids,
                        request.block_hashes, 1, keys, chunks)
    index.rows_stored(1, chunks)
    index.job_finished(1)
    return index


def make_request(request_id: str, prompt: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def child(tokens: int, model: Path, shim_path: str | None, calls: int) -> None:
    from benchmarks.scheduler_rig import make_scheduler
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.base import make_offload_key

    shim = ctypes.CDLL(shim_path) if shim_path else None
    # The native OffloadingConnector (a 16 MiB CPU tier) with rows that travel.
    offload = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                               kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24},
                               kv_load_failure_policy="recompute")
    scheduler = make_scheduler(model, aux=True, num_requests=1,
                               kv_transfer_config=offload, rows_transfer=True)
    prompt = [(7 * i) % 300 + 4 for i in range(tokens + 4)]
    request = make_request("waiting", prompt)
    index = populate(scheduler, request)
    limit = scheduler.connector.connector_scheduler.rows_load_limit

    if shim is None:
        # Wall clock: one cold and one resumed call per fresh waiting request (the
        # same prompt, so the same chunks with rows), medians over `calls`.
        times: dict[str, list[float]] = {"first": [], "next": []}
        for i in range(calls):
            waiting = make_request(f"waiting-{i}", prompt)
            for case in ("first", "next"):
                seconds, value = timed(lambda w=waiting: limit(w, 0))
                times[case].append(seconds)
                assert value == tokens, (case, value, tokens)
        index.forget([make_offload_key(request.block_hashes[1], 0)])
        elapsed, lost = timed(lambda: limit(request, 0))
        assert lost == BLOCK, lost
        print(json.dumps({"first": spread(times["first"]).median,
                          "next": spread(times["next"]).median,
                          "after_loss": elapsed}))
        return

    def measure(case: str) -> int | None:
        assert shim is not None
        shim.cg_start()
        value = limit(request, 0)
        shim.cg_stop(f"{case} tokens={tokens}".encode())
        return value

    first = measure("first")
    # A waiting request asks again every step; with the walk resumed, the next
    # call repeats the first one's answer.
    again = measure("next")
    assert first == again == tokens, (first, again, tokens)
    index.forget([make_offload_key(request.block_hashes[1], 0)])
    lost = measure("after_loss")
    assert lost == BLOCK, lost  # the walk started over and stopped at chunk 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--mode", choices=("callgrind", "wall"),
                        default="callgrind" if shutil.which("valgrind") else "wall")
    parser.add_argument("--calls", type=int, default=200, help="calls per case (wall)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child, Path(args.model), args.shim, args.calls)
        return 0

    from benchmarks.callgrind_shim import build_shim, callgrind_totals
    from tools.testbed.tiny_moe import build

    workdir = Path(tempfile.mkdtemp(prefix="rows-walk-"))
    try:
        model = workdir / "tiny-moe"
        build(model, num_experts=8, num_experts_per_tok=2, seed=0)
        counting = args.mode == "callgrind"
        shim = build_shim(workdir) if counting else None
        unit = "instructions" if counting else "µs"
        print(f"rows_load_limit, one waiting request, every {BLOCK}-token chunk offloaded "
              f"with rows; {unit} per call ({'callgrind' if counting else args.mode})")
        print(f"{'prompt tokens':>13} {'chunks':>7} {'first call':>14} {'next call':>12} "
              f"{'next/first':>11} {'after a loss':>13}")
        figures: dict[str, dict[str, float]] = {}
        for tokens in args.tokens:
            command = [sys.executable, "-m", "benchmarks.offload_rows_limit_walk",
                       "--child", str(tokens), "--model", str(model),
                       "--calls", str(args.calls)]
            env = dict(os.environ, PYTHONHASHSEED="0")
            if counting:
                outdir = workdir / f"cg-{tokens}"
                outdir.mkdir()
                subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                f"--callgrind-out-file={outdir}/cg.%p", *command,
                                "--shim", str(shim)],
                               check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                values = {label.split()[0]: float(n)
                          for label, n in callgrind_totals(outdir).items()}
                fmt = ",.0f"
            else:
                out = subprocess.run(command, check=True, env=env, cwd=ROOT,
                                     capture_output=True, text=True).stdout
                values = {k: v * 1e6 for k, v in json.loads(out.splitlines()[-1]).items()}
                fmt = ",.1f"
            print(f"{tokens:>13,} {tokens // BLOCK:>7,} {values['first']:>14{fmt}} "
                  f"{values['next']:>12{fmt}} {values['next'] / values['first']:>11.4f} "
                  f"{values['after_loss']:>13{fmt}}", flush=True)
            figures[f"{tokens} tokens ({unit})"] = values
        Result("benchmarks.offload_rows_limit_walk", vars(args), figures,
               {f"{key}: next / first": v["next"] / v["first"]
                for key, v in figures.items()}).emit(args.json)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
