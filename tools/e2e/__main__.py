"""Equivalence harness: routed experts under NIXL P/D must equal colocated serving.

    python tools/e2e [--reduced] [--fault no-floor|no-skip|shift-decode-rows] [--workdir DIR]

Starts, on CPU with the installed fork, a prefill and a decode server joined by
NixlConnector, the P/D proxy and a colocated reference server, all on the same
tiny random-weight Qwen3-MoE (built locally), sends each scenario's greedy
requests through the proxy and to the reference, and prints one row per
scenario. Exits 0 only when every scenario has zero mismatches. With --fault,
the decode server carries a planted fault; that run must report mismatches and
exit non-zero (the negative control). The last line is the summary.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cluster import Cluster, ClusterSpec  # noqa: E402
from compare import Outcome, compare, post  # noqa: E402
from scenarios import BLOCK_SIZE, FULL, REDUCED, Req, Scenario, prompt_ids  # noqa: E402
from tiny_moe import build  # noqa: E402

FAULTS = ("no-floor", "no-skip", "shift-decode-rows")


@dataclass
class Result:
    scenario: Scenario
    outcomes: list[Outcome] = field(default_factory=list)
    preemptions: int = 0
    overlap_flips: int = 0
    expired_leases: int = 0
    notes: list[str] = field(default_factory=list)

    failed_to_start: str | None = None

    @property
    def mismatches(self) -> int:
        if self.failed_to_start:
            return max(len(self.scenario.requests), 1)
        bad = sum(1 for o in self.outcomes if o.problem)
        if self.preemptions < self.scenario.min_preemptions:
            bad += 1  # a preemption scenario that saw none proves nothing
        if self.expired_leases:
            bad += 1  # decode may have read freed, reused KV: the run proves nothing
        return bad


def _body(ids: list[int], req: Req, prompt_start: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": ids, "max_tokens": req.max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": 1,
            "routed_experts_prompt_start": prompt_start}


def _conversation(cluster: Cluster, scenario: Scenario, index: int, req: Req) -> list[Outcome]:
    ids = prompt_ids(scenario.seed, index, req.prompt_len)
    reference_url = cluster.servers["reference"].url
    outcomes: list[Outcome] = []
    previous_end = 0
    for _turn in range(scenario.turns):
        start = previous_end if req.prompt_start == "prev" else int(req.prompt_start)
        body = _body(ids, req, min(start, len(ids)))
        reference = post(reference_url, body)
        outcome = compare(post(cluster.proxy_url, body), reference, scenario.expect_dtype)
        outcomes.append(outcome)
        if "error" in reference:
            break
        completion = reference["choices"][0]["token_ids"]
        previous_end = len(ids) + len(completion) - 1
        ids = ids + completion  # turn k+1's prompt = turn k's prompt + completion
    return outcomes


def run_scenario(cluster: Cluster, scenario: Scenario) -> Result:
    result = Result(scenario)
    before = cluster.decode_preemptions()
    flips_before = cluster.overlap_flips()
    expired_before = cluster.expired_leases()
    with ThreadPoolExecutor(max_workers=scenario.concurrency) as pool:
        futures = [pool.submit(_conversation, cluster, scenario, i, req)
                   for i, req in enumerate(scenario.requests)]
        for future in futures:
            result.outcomes.extend(future.result())
    after = cluster.decode_preemptions()
    result.preemptions = max(after - before, 0) if before >= 0 and after >= 0 else 0
    flips_after = cluster.overlap_flips()
    result.expired_leases = cluster.expired_leases() - expired_before
    result.overlap_flips = max(flips_after - flips_before, 0) if flips_before >= 0 else 0
    for outcome in result.outcomes:
        if outcome.problem:
            result.notes.append(outcome.problem)
    return result


def _cluster_spec(group: str, models: dict[str, Path], fault: str | None) -> ClusterSpec:
    if group == "e300":
        return ClusterSpec(models["e300"], fault=fault)
    if group == "preempt":
        return ClusterSpec(models["base"], decode_num_blocks=4, fault=fault)
    return ClusterSpec(models["base"], fault=fault)


def print_table(results: list[Result]) -> None:
    header = (f"{'scenario':36} {'requests':>8} {'same tokens':>11} {'same rows':>9} "
              f"{'max|dlogprob|':>13} {'preempt':>7} {'P-1 flips':>9} {'mismatches':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        n = len(r.outcomes)
        print(f"{r.scenario.name:36} {n:8d} {sum(o.tokens_equal for o in r.outcomes):11d} "
              f"{sum(o.rows_equal for o in r.outcomes):9d} "
              f"{max((o.max_logprob_delta for o in r.outcomes), default=0.0):13.2e} "
              f"{r.preemptions:7d} {r.overlap_flips:9d} {r.mismatches:10d}")
    for r in results:
        for note in dict.fromkeys(r.notes):
            print(f"  {r.scenario.name}: {note[:400]}")
        if r.failed_to_start:
            print(f"  {r.scenario.name}: deployment failed to start: {r.failed_to_start}")
        elif r.preemptions < r.scenario.min_preemptions:
            print(f"  {r.scenario.name}: expected at least {r.scenario.min_preemptions} decode "
                  f"preemption(s), saw {r.preemptions}")
        if r.expired_leases:
            print(f"  {r.scenario.name}: prefill released {r.expired_leases} request(s)' KV "
                  "on lease expiry before decode read it (decode may have read reused blocks)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="the short version run by make test")
    parser.add_argument("--fault", choices=FAULTS, help="plant a fault on the decode server")
    parser.add_argument("--workdir", type=Path, help="models and server logs (default: temp dir)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these scenario names")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-fork-e2e-"))
    scenarios = [s for s in (REDUCED if args.reduced else FULL)
                 if args.only is None or s.name in args.only]
    groups = list(dict.fromkeys(s.group for s in scenarios))
    models = {"base": workdir / "tiny-moe", "e300": workdir / "tiny-moe-300"}
    build(models["base"], num_experts=8, num_experts_per_tok=2, seed=0)
    if "e300" in groups:
        build(models["e300"], num_experts=300, num_experts_per_tok=2, seed=0)
    print(f"e2e: {len(scenarios)} scenarios in {len(groups)} deployment(s), block size "
          f"{BLOCK_SIZE}, fault: {args.fault or 'none'}, logs under {workdir}", flush=True)

    results: list[Result] = []
    start = time.monotonic()
    for group in groups:
        cluster = Cluster(_cluster_spec(group, models, args.fault), logs=workdir / f"logs-{group}")
        try:
            startup = cluster.start()
        except (RuntimeError, TimeoutError) as exc:
            reason = str(exc).splitlines()[0]
            print(f"e2e: deployment {group!r} failed to start: {reason}", flush=True)
            results += [Result(s, failed_to_start=reason) for s in scenarios if s.group == group]
            continue
        print(f"e2e: deployment {group!r} up in {startup:.0f} s "
              f"(prefill, decode, proxy {cluster.proxy_url}, reference)", flush=True)
        try:
            for scenario in (s for s in scenarios if s.group == group):
                result = run_scenario(cluster, scenario)
                results.append(result)
                print(f"e2e: {scenario.name}: {len(result.outcomes)} requests, "
                      f"{result.mismatches} mismatches", flush=True)
        finally:
            cluster.stop()
    print()
    print_table(results)
    print("P-1 flips: rows at P - 1 where the decode instance's own forward chose other experts "
          "than prefill; the proxy kept prefill's row, as colocated serving computes it. Not a "
          "mismatch by itself: a decode computation that really diverged also shows up as "
          "differing tokens or rows.")
    total = sum(r.mismatches for r in results)
    print(f"e2e: {len(results)} scenarios, {total} mismatches "
          f"({time.monotonic() - start:.0f} s, fault: {args.fault or 'none'})")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
