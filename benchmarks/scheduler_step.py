#!/usr/bin/env python3
"""Scheduler step cost, fork vs stock vLLM 0.31.0, side by side in one process.

    .venv/bin/python -m benchmarks.scheduler_step [--requests 256] [--steps N] [--rounds N]
                                                  [--mode callgrind|wall]

"stock" runs upstream's own scheduler.py and aux_output_connector/connector.py,
read from the pinned base wheel in the build cache and loaded as separate
modules (everything they import is the installed fork, which the series does
not change on these paths); "fork" runs the installed, patched modules. Each
round times `--steps` decode steps (schedule + update_from_output) with
`--requests` running requests, for both variants in alternation, with routed
experts on and off, and reports the fork/stock ratio per step.

The default measure is instructions executed (valgrind's callgrind, counted
only around the measured steps): deterministic, so a 1% difference is
visible on a shared 2-core machine where wall time swings by 10%. `--mode
wall` times the same steps with perf_counter (median of rounds) when valgrind
is not installed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
# MRV2 is the runner routed experts need; on CPU it needs the fork's Triton opt-in.
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("VLLM_CPU_TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from forkbuild.build import BuildRequest, resolve  # noqa: E402
from tests.v1.tiny_moe import build  # noqa: E402  (run from the root: python -m)


def load_stock_module(name: str, member: str) -> ModuleType:
    _, _, wheel = resolve(BuildRequest(ROOT, "cpu", "x86_64", ROOT / "dist"))
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(member).decode()
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"<stock {member}>"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def make_scheduler(scheduler_cls: type, model: Path, aux: bool, num_requests: int) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model), dtype="float32", seed=0)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=num_requests,
                                         max_num_batched_tokens=8192, max_model_len=4096,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
    )
    config.aux_output_config.enable_return_routed_experts = aux
    num_blocks = num_requests * 64
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return scheduler_cls(vllm_config=config, kv_cache_config=kv, log_stats=False,
                         structured_output_manager=StructuredOutputManager(config),
                         block_size=16)


def make_requests(n: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    requests = []
    for i in range(n):
        params = SamplingParams(max_tokens=100000, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        requests.append(Request(request_id=f"r{i}", prompt_token_ids=[(i * 7 + j) % 500 + 4
                                                                       for j in range(32)],
                                sampling_params=params, pooling_params=None, mm_features=None,
                                block_hasher=get_request_block_hasher(16, sha256)))
    return requests


def step_output(scheduler_output: Any, aux: bool, scheduler: Any) -> Any:
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    aux_out = None
    if aux:
        aux_out = {}
        for rid in ids:
            req = scheduler.requests[rid]
            # schedule() has already advanced num_computed_tokens past this chunk.
            count = scheduler_output.num_scheduled_tokens[rid]
            start = req.num_computed_tokens - count
            aux_out[rid] = AuxRequestOutput(start, np.zeros((count, 2, 2), np.uint8))
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             aux_output_connector_output=aux_out)


def prepared_scheduler(scheduler_cls: type, model: Path, aux: bool, n: int) -> Any:
    """A scheduler with `n` running requests whose prefill is done."""
    scheduler = make_scheduler(scheduler_cls, model, aux, n)
    for request in make_requests(n):
        scheduler.add_request(request)
    for _ in range(5):  # admit everything, finish prefill, warm the decode path
        out = scheduler.schedule()
        scheduler.update_from_output(out, step_output(out, aux, scheduler))
    assert len(scheduler.running) == n, len(scheduler.running)
    return scheduler


def run_steps(scheduler: Any, aux: bool, steps: int) -> None:
    for _ in range(steps):
        out = scheduler.schedule()
        scheduler.update_from_output(out, step_output(out, aux, scheduler))


def timed_steps(scheduler_cls: type, model: Path, aux: bool, n: int, steps: int) -> float:
    scheduler = prepared_scheduler(scheduler_cls, model, aux, n)
    start = time.perf_counter()
    run_steps(scheduler, aux, steps)
    return (time.perf_counter() - start) / steps


# Instruction counting: the child runs under `valgrind --tool=callgrind
# --instr-atstart=no`; a three-function shim (compiled here with gcc against
# valgrind's callgrind.h) switches instrumentation on around the measured steps
# only and dumps one profile per measurement, labelled with its name.
CALLGRIND_SHIM = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(const char *label) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(label); }
"""


def build_shim(workdir: Path) -> Path:
    source, library = workdir / "cg_shim.c", workdir / "cg_shim.so"
    source.write_text(CALLGRIND_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)],
                   check=True)
    return library


def child(args: argparse.Namespace, variants: dict[str, type], model: Path) -> int:
    """Runs under callgrind: every variant, `--rounds` times, each measurement dumped."""
    shim = ctypes.CDLL(str(args.shim))
    aux = args.aux == "on"
    for round_index in range(args.rounds):
        for name, cls in variants.items():
            scheduler = prepared_scheduler(cls, model, aux, args.requests)
            shim.cg_start()
            run_steps(scheduler, aux, args.steps)
            shim.cg_stop(f"{name} aux={args.aux} round={round_index}".encode())
    return 0


def read_dumps(outdir: Path) -> dict[tuple[str, int], int]:
    """(variant, round) -> instructions executed, from the labelled callgrind dumps."""
    counts: dict[tuple[str, int], int] = {}
    for path in outdir.glob("cg.*"):
        label, total = None, None
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("desc: Trigger: Client Request: "):
                label = line.removeprefix("desc: Trigger: Client Request: ")
            elif line.startswith("totals: "):
                total = int(line.split()[1])
        if label and total is not None:
            name, _aux, round_part = label.split()
            counts[(name, int(round_part.split("=")[1]))] = total
    return counts


def instruction_counts(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sched-bench-cg-"))
    shim = build_shim(workdir)
    print(f"{args.requests} running requests, {args.steps} decode steps per measurement, "
          f"instructions counted by callgrind (deterministic; last of {args.rounds} rounds)")
    print(f"{'routed experts':15} {'stock instr/step':>17} {'fork instr/step':>16} "
          f"{'fork/stock':>11}")
    env = dict(os.environ, PYTHONHASHSEED="0")
    for aux in ("on", "off"):
        outdir = workdir / f"aux-{aux}"
        outdir.mkdir()
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={outdir}/cg.%p", sys.executable, "-m",
                        "benchmarks.scheduler_step",
                        "--child", "--shim", str(shim), "--aux", aux,
                        "--requests", str(args.requests), "--steps", str(args.steps),
                        "--rounds", str(args.rounds)],
                       check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        counts = read_dumps(outdir)
        last = args.rounds - 1
        stock, fork = counts[("stock", last)] / args.steps, counts[("fork", last)] / args.steps
        print(f"{aux:15} {stock:17,.0f} {fork:16,.0f} {fork / stock:11.4f}", flush=True)
    return 0


def wall_clock(args: argparse.Namespace, variants: dict[str, type], model: Path) -> int:
    print(f"{args.requests} running requests, {args.steps} decode steps per round, "
          f"{args.rounds} rounds, alternating, wall clock (noisy on shared machines)")
    print(f"{'routed experts':15} {'stock ms/step':>14} {'fork ms/step':>13} {'fork/stock':>11}")
    for aux in (True, False):
        times: dict[str, list[float]] = {"stock": [], "fork": []}
        for cls in variants.values():  # warm-up round, not counted
            timed_steps(cls, model, aux, args.requests, max(args.steps // 10, 1))
        for _ in range(args.rounds):
            for name, cls in variants.items():
                times[name].append(timed_steps(cls, model, aux, args.requests, args.steps))
        stock, fork = statistics.median(times["stock"]), statistics.median(times["fork"])
        print(f"{'on' if aux else 'off':15} {stock * 1e3:14.3f} {fork * 1e3:13.3f} "
              f"{fork / stock:11.3f}")
    return 0


def variants_and_model() -> tuple[dict[str, type], Path]:
    from vllm.v1.core.sched import scheduler as fork_sched

    stock_connector = load_stock_module(
        "stock_aux_connector", "vllm/distributed/aux_output_connector/connector.py")
    stock_sched = load_stock_module("stock_scheduler", "vllm/v1/core/sched/scheduler.py")
    stock_sched.AuxOutputSchedulerConnector = stock_connector.AuxOutputSchedulerConnector
    model = Path(tempfile.mkdtemp(prefix="sched-bench-")) / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    return {"stock": stock_sched.Scheduler, "fork": fork_sched.Scheduler}, model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps per measurement (default: 20 callgrind, 200 wall)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measurement rounds (default: 2 callgrind, 7 wall)")
    parser.add_argument("--mode", choices=("callgrind", "wall"),
                        default="callgrind" if shutil.which("valgrind") else "wall")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shim", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--aux", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    counting = args.mode == "callgrind" or args.child
    args.steps = args.steps or (20 if counting else 200)
    args.rounds = args.rounds or (2 if counting else 7)
    if args.mode == "callgrind" and not args.child:
        return instruction_counts(args)
    variants, model = variants_and_model()
    if args.child:
        return child(args, variants, model)
    return wall_clock(args, variants, model)


if __name__ == "__main__":
    sys.exit(main())
