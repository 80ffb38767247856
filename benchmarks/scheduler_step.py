#!/usr/bin/env python3
"""Scheduler step cost, fork vs stock vLLM 0.31.0, side by side in one run.

    .venv/bin/python -m benchmarks.scheduler_step [--requests 256] [--steps N] [--rounds N]
                                                  [--mode callgrind|wall]
                                                  [--fork-src DIR] [--stock-src DIR]

Each variant runs in its own process with its own `vllm` package: the Python
files of one source tree over the installed package's compiled extensions and
data files (symlinked, so nothing is copied or changed). "stock" is the
unpatched base: by default the Python sources of the pinned base wheel in the
build cache. "fork" is by default the installed fork (the test venv's vllm);
`--fork-src` points it at a working tree instead, e.g. one made by
`python -m tools.fork checkout --base cpu --dir DIR`, to measure an edit before it is
exported and built. Both processes run this same script on the same tiny MoE
checkpoint, so the workload is identical: `--steps` decode steps (schedule +
update_from_output) with `--requests` running requests, routed experts on and
then off, `--rounds` times; the ratio is fork/stock per step.

The default measure is instructions executed (valgrind's callgrind, counted
only around the measured steps and off while the stand-in worker builds each
step's output, with the garbage collector off and, where
`setarch` exists, without address-space randomisation): far steadier than
wall time, which swings by 10% on a shared 2-core machine, though not exact:
identical sources still move by up to 0.4% between runs (the stock variant
unpacked from the wheel the most), so compare the median of several runs. `--mode
wall` times the same steps with perf_counter (median of rounds, one process
per variant and round, alternating: benchmarks/measure.py) when valgrind is not
installed.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.callgrind_shim import build_shim, callgrind_totals
from benchmarks.measure import Result, add_json_option, run_rounds, spread, timed
from benchmarks.scheduler_rig import make_scheduler

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = ("stock", "fork")
AUX_SETTINGS = ("on", "off")


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
    # req_id_to_index is a field before vLLM 0.34.0, which derives it from req_ids.
    index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}
             if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
             else {})
    return ModelRunnerOutput(req_ids=ids, **index,
                             sampled_token_ids=[[7] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             aux_output_connector_output=aux_out)


def prepared_scheduler(model: Path, aux: bool, n: int) -> Any:
    """A scheduler with `n` running requests whose prefill is done."""
    scheduler = make_scheduler(model, aux, n)
    for request in make_requests(n):
        scheduler.add_request(request)
    for _ in range(5):  # admit everything, finish prefill, warm the decode path
        out = scheduler.schedule()
        scheduler.update_from_output(out, step_output(out, aux, scheduler))
    assert len(scheduler.running) == n, len(scheduler.running)
    return scheduler


def run_steps(scheduler: Any, aux: bool, steps: int, shim: Any = None) -> None:
    """`steps` decode steps; with the callgrind `shim`, the stand-in worker's
    output is built with counting off (only schedule + update_from_output count)."""
    for _ in range(steps):
        out = scheduler.schedule()
        if shim is not None:
            shim.cg_toggle()
        worker_output = step_output(out, aux, scheduler)
        if shim is not None:
            shim.cg_toggle()
        scheduler.update_from_output(out, worker_output)


# Each variant's `vllm` package: a tree of directories whose Python files are
# symlinks into one source tree and whose other files (compiled extensions,
# configs) are symlinks into the installed package. The child process finds it
# first on PYTHONPATH; bytecode caches are written into the tree, not the sources.
def installed_package() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates it without importing it
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    return Path(spec.origin).parent


def stock_sources(workdir: Path) -> Path:
    """The pinned base wheel's Python files, unpacked under workdir/stock-src."""
    from tools.forkbuild.build import BuildRequest, resolve

    _, _, wheel = resolve(BuildRequest(ROOT, "cpu", "x86_64", ROOT / "dist"))
    root = workdir / "stock-src"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root, [m for m in zf.namelist()
                             if m.startswith("vllm/") and m.endswith(".py")])
    return root


def assemble_package(sources: Path, dest: Path) -> Path:
    """dest/vllm: sources/vllm's Python files over the installed package's others."""
    src, installed = sources / "vllm", installed_package()
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"{sources} has no vllm/__init__.py: not a vllm source tree")
    for origin, keep in ((installed, lambda f: f.suffix != ".py"),
                         (src, lambda f: f.suffix == ".py")):
        for path in origin.rglob("*"):
            if path.is_dir() or "__pycache__" in path.parts or not keep(path):
                continue
            target = dest / "vllm" / path.relative_to(origin)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path.resolve())
    return dest


def child(args: argparse.Namespace) -> int:
    """One variant's process: `--rounds` rounds of routed experts on, then off.

    Under callgrind each measurement is dumped with its label; in wall mode the
    seconds per step are printed as one JSON object. `--rounds 0` only imports
    and warms up (it writes the bytecode caches before a measured run).
    """
    import vllm

    package = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "vllm"  # child_env
    assert Path(vllm.__file__).parent == package, f"{vllm.__file__} is not in {package}"
    shim = ctypes.CDLL(str(args.shim)) if args.shim else None
    seconds: dict[str, list[float]] = {aux: [] for aux in AUX_SETTINGS}
    for aux in AUX_SETTINGS if args.rounds == 0 else ():
        run_steps(prepared_scheduler(args.model, aux == "on", 2), aux == "on", 1)
    for round_index in range(args.rounds):
        for aux in AUX_SETTINGS:
            scheduler = prepared_scheduler(args.model, aux == "on", args.requests)
            if shim is not None:
                # No collection inside the counted window: where one lands depends
                # on what each variant allocated before, and one landing in only
                # one variant's window moved the ratio by 0.6 %.
                gc.collect()
                gc.disable()
                shim.cg_start()
                run_steps(scheduler, aux == "on", args.steps, shim)
                shim.cg_stop(f"{args.child} aux={aux} round={round_index}".encode())
                gc.enable()
            else:
                elapsed, _ = timed(lambda s=scheduler, a=aux: run_steps(s, a == "on",
                                                                         args.steps))
                seconds[aux].append(elapsed / args.steps)
    if shim is None and args.rounds:
        print(json.dumps(seconds))
    return 0


def child_env(package: Path, **extra: str) -> dict[str, str]:
    """A child's environment: its own vllm `package` first on PYTHONPATH, then the
    repository root, for the benchmarks' libraries (the child runs this file by path;
    a regular package wins over the root's vllm/, a namespace of patch sources)."""
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join((str(package), str(ROOT))))


def child_command(args: argparse.Namespace, variant: str, model: Path, rounds: int,
                  shim: Path | None = None) -> list[str]:
    command = [sys.executable, __file__, "--child", variant, "--model", str(model),
               "--requests", str(args.requests), "--steps", str(args.steps),
               "--rounds", str(rounds)]
    return command + (["--shim", str(shim)] if shim else [])


def read_dumps(outdir: Path) -> dict[tuple[str, str, int], int]:
    """(variant, aux, round) -> instructions executed, from the labelled dumps."""
    counts: dict[tuple[str, str, int], int] = {}
    for label, total in callgrind_totals(outdir).items():
        name, aux_part, round_part = label.split()
        counts[(name, aux_part.split("=")[1], int(round_part.split("=")[1]))] = total
    return counts


def print_table(unit: str, per_step: dict[tuple[str, str], float], scale: float,
                fmt: str) -> None:
    print(f"{'routed experts':15} {'stock ' + unit:>17} {'fork ' + unit:>17} {'fork/stock':>11}")
    for aux in AUX_SETTINGS:
        stock, fork = per_step[("stock", aux)], per_step[("fork", aux)]
        print(f"{aux:15} {stock * scale:17{fmt}} {fork * scale:17{fmt}} {fork / stock:11.4f}")


def no_aslr() -> list[str]:
    """A command prefix that runs a process without address-space randomisation
    (util-linux setarch), where there is one: where objects land decides how
    sets of them collide, which moved a variant's count by up to 0.4 % between
    identical runs."""
    return ["setarch", platform.machine(), "-R"] if shutil.which("setarch") else []


def instruction_counts(args: argparse.Namespace, packages: dict[str, Path], model: Path,
                       workdir: Path) -> dict[tuple[str, str], float]:
    shim = build_shim(workdir)
    print(f"{args.requests} running requests, {args.steps} decode steps per measurement, "
          f"instructions counted by callgrind (deterministic; last of {args.rounds} rounds)",
          flush=True)
    per_step: dict[tuple[str, str], float] = {}
    for variant in VARIANTS:
        outdir = workdir / f"cg-{variant}"
        outdir.mkdir()
        env = child_env(packages[variant], PYTHONHASHSEED="0")
        subprocess.run([*no_aslr(), "valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={outdir}/cg.%p",
                        *child_command(args, variant, model, args.rounds, shim)],
                       check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        counts = read_dumps(outdir)
        for aux in AUX_SETTINGS:
            per_step[(variant, aux)] = counts[(variant, aux, args.rounds - 1)] / args.steps
    if args.keep:
        print(f"callgrind profiles: {workdir}/cg-stock, {workdir}/cg-fork")
    print_table("instr/step", per_step, 1, ",.0f")
    return per_step


def wall_clock(args: argparse.Namespace, packages: dict[str, Path], model: Path
               ) -> dict[tuple[str, str], float]:
    print(f"{args.requests} running requests, {args.steps} decode steps per round, "
          f"{args.rounds} rounds, one process per variant and round, alternating, "
          "wall clock (noisy on shared machines)", flush=True)

    def one_process(variant: str, _: int) -> dict[str, float]:
        """Seconds per step with routed experts on and off, one fresh process."""
        env = child_env(packages[variant], PYTHONHASHSEED="0")
        # Two rounds per process: the first one warms the decode path up.
        out = subprocess.run(child_command(args, variant, model, 2), check=True,
                             env=env, capture_output=True, text=True).stdout
        return {aux: seconds[-1] for aux, seconds in json.loads(out.splitlines()[-1]).items()}

    rounds = run_rounds(VARIANTS, args.rounds, one_process)
    per_step = {(variant, aux): spread(r[aux] for r in rounds[variant]).median
                for variant in VARIANTS for aux in AUX_SETTINGS}
    print_table("ms/step", per_step, 1e3, ".3f")
    return per_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps per measurement (default: 20 callgrind, 200 wall)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measurement rounds (default: 2 callgrind, 7 wall)")
    parser.add_argument("--mode", choices=("callgrind", "wall"),
                        default="callgrind" if shutil.which("valgrind") else "wall")
    parser.add_argument("--fork-src", type=Path, default=None,
                        help="directory holding the fork's vllm/ sources "
                        "(default: the installed vllm)")
    parser.add_argument("--stock-src", type=Path, default=None,
                        help="directory holding stock vllm/ sources "
                        "(default: the pinned base wheel's)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (callgrind profiles) and print it")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shim", type=Path, help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    counting = args.mode == "callgrind"
    args.steps = args.steps or (20 if counting else 200)
    args.rounds = args.rounds if args.rounds is not None else (2 if counting else 7)
    if args.child:
        return child(args)

    from tools.testbed.tiny_moe import build  # run from the root: python -m

    workdir = Path(tempfile.mkdtemp(prefix="sched-bench-"))
    try:
        model = workdir / "tiny-moe"
        build(model, num_experts=8, num_experts_per_tok=2, seed=0)
        sources = {"stock": args.stock_src or stock_sources(workdir),
                   "fork": args.fork_src or installed_package().parent}
        packages = {}
        for variant in VARIANTS:
            packages[variant] = assemble_package(sources[variant].resolve(),
                                                 workdir / f"{variant}-pkg")
            env = child_env(packages[variant])
            subprocess.run(child_command(args, variant, model, 0), check=True, env=env,
                           stdout=subprocess.DEVNULL)  # imports once: bytecode caches
            print(f"{variant}: vllm sources from {sources[variant]}", flush=True)
        per_step = (instruction_counts(args, packages, model, workdir) if counting
                    else wall_clock(args, packages, model))
        Result("benchmarks.scheduler_step", vars(args),
               {f"{variant} {aux}": value for (variant, aux), value in per_step.items()},
               {f"routed experts {aux}: fork / stock":
                per_step[("fork", aux)] / per_step[("stock", aux)] for aux in AUX_SETTINGS}
               ).emit(args.json)
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
