"""Equivalence harness: routed experts under NIXL P/D must equal colocated serving.

    python -m tools.e2e [--reduced] [--fault NAME] [--only SCENARIO ...] [--workdir DIR]
                     [--pd-chain FLAGS] [--model PATH --serve-args ARGS --kv-buffer-device D]

Starts, on CPU with the installed fork, a prefill and a decode server joined by
NixlConnector, the P/D proxy and a colocated reference server, all on the same
tiny random-weight Qwen3-MoE (built locally), sends each scenario's greedy
requests through the proxy and to the reference, and prints one row per
scenario. KV-offload scenarios run multi-turn conversations against a server
with vLLM's OffloadingConnector and a small KV cache (colocated, or on the
prefill side of P/D), beside a twin with routed experts off whose loads nothing
limits. Exits 0 only when every scenario has zero mismatches. With --fault, the
server under test carries a planted fault; that run must report mismatches and
exit non-zero (the negative control). The last line is the summary.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    RoleConfigError,
    validate_deployment,
)
from vllm.entrypoints.cli.kv_transfer_config import (
    KVTransferConfigSubcommand,
    deployment_from_args,
)

from tools.testbed.tiny_moe import build
from tools.e2e.cluster import (
    CPU_SERVE_ARGS,
    LEAK_GAUGES,
    Cluster,
    ClusterSpec,
    mooncake_pd,
    native,
    unwind_on_sigterm,
)
from tools.e2e.compare import Outcome, compare, post
from tools.e2e.scenarios import (
    BLOCK_SIZE,
    FULL,
    LONG_CONTEXT,
    REDUCED,
    Req,
    Scenario,
    prompt_ids,
)

FAULTS = ("no-floor", "no-skip", "shift-decode-rows", "no-clamp", "no-row-transfer",
          "corrupt-row-tag", "rows-not-imported", "corrupt-rows", "leak-floors")
# The deployments of plain NIXL P/D (no KV offload).
PD_GROUPS = ("base", "preempt", "xpyd", "e300")
# Faults of the rows that travel with the KV: they need --rows-transfer.
ROWS_TRANSFER_FAULTS = ("no-row-transfer", "corrupt-row-tag", "rows-not-imported",
                        "corrupt-rows")
# What --rows-transfer runs by default: P/D, and the native offload (colocated and on
# prefill) whose chunks carry their rows.
ROWS_TRANSFER_GROUPS = (*PD_GROUPS, "offload-colocated", "offload-pd")
# With rows that travel with offloaded chunks, the subject must load (nearly) what its
# twin without routed experts loads on the same traffic.
MIN_LOAD_RATIO = 0.99
LOADED_TOKENS = "vllm:external_prefix_cache_hits_total"  # tokens a KV connector loaded
DECODE_HIT_TOKENS = "vllm:prefix_cache_hits_total"  # tokens from decode's own prefix cache
PROMPT_TOKENS = "vllm:prompt_tokens_total"
STORE_ERROR = "BlockObjectStoreError"
ROWS_LOADED = "vllm:routed_experts_rows_loaded_total"  # rows that came with loaded KV
# Offloaded tokens the routed-experts limit kept out of the subject's loads, as the
# server counts them (native CPU tier only).
WITHHELD_COUNTED = "vllm:kv_offload_routed_experts_withheld_tokens_total"
# Per-request state of the routed-experts control plane: 0 once every request finished.
LEAK_WAIT_S = 10.0  # a step's stats can reach /metrics just after its response


@dataclass
class Result:
    scenario: Scenario
    outcomes: list[Outcome] = field(default_factory=list)
    preemptions: int = 0
    overlap_flips: int = 0
    expired_leases: int = 0
    loaded_tokens: int = 0  # by the offload connector of the server under test
    withheld_tokens: int | None = None  # the twin's loads minus the subject's
    withheld_counted: int = 0  # what the subject's metric says it withheld
    store_errors: int = 0  # BlockObjectStoreError in any server log
    rows_check_failures: int = 0  # pulled blocks whose rows failed decode's check
    rows_loaded: int = 0  # positions whose rows came with loaded KV, on every server
    leaked_state: int = 0  # LEAK_GAUGES summed over the servers after the scenario
    recovered_loads: int = 0  # KV load failures decode recomputed
    decode_hit_tokens: int = 0  # tokens decode took from its own prefix cache
    prefills_used: int = 0  # prefill instances that computed some of the prompts
    # Rows travel with the subject's offloaded chunks: its loads ÷ the twin's must reach
    # this (0: no such requirement).
    min_load_ratio: float = 0.0
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
        # Transferred rows that fail their check are recomputed, never emitted; in a
        # run without a planted fault any such block is still a defect.
        bad += self.rows_check_failures
        if self.leaked_state:
            bad += 1  # finished requests left state behind: a long run would grow
        if self.loaded_tokens < self.scenario.min_loaded_tokens:
            bad += 1  # an offload scenario that loaded nothing proves nothing
        if self.decode_hit_tokens < self.scenario.min_decode_hit_tokens:
            bad += 1  # a reuse scenario whose decode reused nothing proves nothing
        if self.prefills_used < self.scenario.min_prefills_used:
            bad += 1  # an xPyD scenario that used one prefill proves nothing more
        if self.load_ratio_short:
            bad += 1  # offload hits lost although the chunks carry their rows
        return bad + self.store_errors

    @property
    def load_ratio(self) -> float | None:
        """The subject's loaded tokens ÷ its twin's, when the twin loaded any."""
        if self.withheld_tokens is None:
            return None
        twin = self.loaded_tokens + self.withheld_tokens
        return self.loaded_tokens / twin if twin > 0 else None

    @property
    def load_ratio_short(self) -> bool:
        ratio = self.load_ratio
        return ratio is not None and ratio < self.min_load_ratio


def _body(ids: list[int], req: Req, prompt_start: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": ids, "max_tokens": req.max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": 1,
            "routed_experts_prompt_start": prompt_start}


@dataclass
class Conversation:
    """One request's turns: turn k+1's prompt is turn k's prompt + completion."""

    req: Req
    ids: list[int]
    previous_end: int = 0
    done: bool = False

    def body(self) -> dict[str, Any]:
        start = self.previous_end if self.req.prompt_start == "prev" else int(self.req.prompt_start)
        return _body(self.ids, self.req, min(start, len(self.ids)))


def _without_rows(body: dict[str, Any]) -> dict[str, Any]:
    """The body for the twin, a server without --enable-return-routed-experts: it
    refuses a routed_experts_prompt_start (HTTP 400) instead of ignoring it."""
    return {key: value for key, value in body.items()
            if key != "routed_experts_prompt_start"}


def _turn(cluster: Cluster, scenario: Scenario, conversation: Conversation) -> Outcome:
    body = conversation.body()
    reference = post(cluster.servers["reference"].url, body)
    label = "offload" if cluster.spec.topology == "colocated" else "P/D"
    outcome = compare(post(cluster.url, body), reference, scenario.expect_dtype, label)
    if "twin" in cluster.servers and scenario.twin:  # the same traffic: comparable loads
        twin_body = _without_rows(body)
        if cluster.spec.topology == "pd":  # a twin prefill: what the proxy sends prefill
            twin_body["max_tokens"] = 1
        twin = post(cluster.servers["twin"].url, twin_body)
        if "error" in twin:
            outcome.problem = "; ".join(
                filter(None, [f"twin failed: {twin['error'][:300]}", outcome.problem]))
    if "error" in reference:
        conversation.done = True
        return outcome
    completion = reference["choices"][0]["token_ids"]
    conversation.previous_end = len(conversation.ids) + len(completion) - 1
    if not scenario.resend:
        conversation.ids = conversation.ids + completion
    return outcome


def _run_conversation(cluster: Cluster, scenario: Scenario,
                      conversation: Conversation) -> list[Outcome]:
    outcomes = []
    for _turn_index in range(scenario.turns):
        if conversation.done:
            break
        outcomes.append(_turn(cluster, scenario, conversation))
    return outcomes


def _counters(cluster: Cluster, subject: str) -> dict[str, int]:
    return {
        "preemptions": cluster.decode_preemptions(),
        "flips": cluster.overlap_flips(),
        "expired": cluster.expired_leases(),
        "loaded": cluster.metric(subject, LOADED_TOKENS),
        "twin_loaded": cluster.metric("twin", LOADED_TOKENS),
        "withheld_counted": cluster.metric(subject, WITHHELD_COUNTED),
        "store_errors": sum(cluster.log_count(name, STORE_ERROR) for name in cluster.servers),
        "rows_check_failures": cluster.rows_check_failures(),
        "rows_loaded": sum(max(cluster.metric(name, ROWS_LOADED), 0)
                           for name in cluster.servers),
        "recovered_loads": cluster.recovered_loads(),
        "decode_hits": cluster.metric("decode", DECODE_HIT_TOKENS),
        **{f"prompt_tokens:{name}": cluster.metric(name, PROMPT_TOKENS)
           for name in cluster.prefill_names},
    }


def leaked_state(cluster: Cluster, wait_s: float = LEAK_WAIT_S) -> int:
    """The fork's per-request gauges summed over the servers, once they read 0 or
    after ``wait_s``: every request of the scenario has finished, so anything left
    is leaked."""
    deadline = time.monotonic() + wait_s
    while True:
        total = sum(max(cluster.metric(name, gauge), 0)
                    for name in cluster.servers for gauge in LEAK_GAUGES)
        if total == 0 or time.monotonic() >= deadline:
            return total
        time.sleep(0.5)


def run_scenario(cluster: Cluster, scenario: Scenario) -> Result:
    result = Result(scenario)
    subject = "subject" if cluster.spec.topology == "colocated" else "prefill"
    before = _counters(cluster, subject)
    conversations = [Conversation(req, prompt_ids(scenario.seed, i, req.prompt_len))
                     for i, req in enumerate(scenario.requests)]
    if scenario.interleave:
        for _turn_index in range(scenario.turns):
            for conversation in conversations:
                if not conversation.done:
                    result.outcomes.append(_turn(cluster, scenario, conversation))
    else:
        with ThreadPoolExecutor(max_workers=scenario.concurrency) as pool:
            futures = [pool.submit(_run_conversation, cluster, scenario, c)
                       for c in conversations]
            for future in futures:
                result.outcomes.extend(future.result())
    after = _counters(cluster, subject)
    delta = {key: max(after[key] - before[key], 0) if min(after[key], before[key]) >= 0 else 0
             for key in before}
    result.preemptions = delta["preemptions"]
    result.overlap_flips = delta["flips"]
    result.expired_leases = delta["expired"]
    result.loaded_tokens = delta["loaded"] if cluster.spec.roles_with_offload else 0
    if "twin" in cluster.servers and scenario.twin:
        result.withheld_tokens = delta["twin_loaded"] - delta["loaded"]
        result.withheld_counted = delta["withheld_counted"]
        if cluster.spec.rows_transfer:
            result.min_load_ratio = MIN_LOAD_RATIO
    result.store_errors = delta["store_errors"]
    result.rows_check_failures = delta["rows_check_failures"]
    result.rows_loaded = delta["rows_loaded"]
    result.leaked_state = leaked_state(cluster)
    result.recovered_loads = delta["recovered_loads"]
    result.decode_hit_tokens = delta["decode_hits"]
    result.prefills_used = sum(delta[f"prompt_tokens:{name}"] > 0
                               for name in cluster.prefill_names)
    for outcome in result.outcomes:
        if outcome.problem:
            result.notes.append(outcome.problem)
    return result


# Offload deployments: a KV cache of 8 blocks (256 tokens) beside a 64 MiB CPU tier,
# so a conversation's next turn finds its earlier blocks evicted by the others.
OFFLOAD_NUM_BLOCKS = 8


@dataclass(frozen=True)
class HarnessOptions:
    fault: str | None = None
    pd_chain: Deployment | None = None  # the base group's chains (None: NIXL alone)
    serve_args: tuple[str, ...] = CPU_SERVE_ARGS
    kv_buffer_device: str = "cpu"
    enforce_eager: bool = True
    rows_transfer: bool = False
    rows_transfer_only_on: str | None = None
    router: str = "pdproxy"
    kv_load_failure_policy: str | None = None


def pd_deployment(flags: str | None) -> Deployment | None:
    """The deployment `vllm kv-transfer-config --role decode FLAGS` describes."""
    if flags is None:
        return None
    parser = argparse.ArgumentParser(prog="--pd-chain")
    KVTransferConfigSubcommand().subparser_init(parser.add_subparsers())
    parsed = parser.parse_args(["kv-transfer-config", "--role", "decode", *shlex.split(flags)])
    deployment = deployment_from_args(parsed)
    try:  # refuse a bad deployment here, not when its servers start
        validate_deployment(deployment)
    except RoleConfigError as exc:
        parser.error(str(exc))
    return deployment


def _cluster_spec(group: str, models: dict[str, Path], options: HarnessOptions) -> ClusterSpec:
    common: dict[str, Any] = {"fault": options.fault, "serve_args": options.serve_args,
                              "kv_buffer_device": options.kv_buffer_device,
                              "enforce_eager": options.enforce_eager,
                              "rows_transfer": options.rows_transfer,
                              "rows_transfer_only_on": options.rows_transfer_only_on,
                              "router": options.router,
                              "kv_load_failure_policy": options.kv_load_failure_policy}
    pd_chain = options.pd_chain or Deployment(pd=True)
    if group == "e300":
        return ClusterSpec(models["e300"], **common)
    if group == "xpyd":
        return ClusterSpec(models["base"], deployment=pd_chain, num_prefill=2, **common)
    if group == "preempt":
        return ClusterSpec(models["base"], deployment=pd_chain, decode_num_blocks=4, **common)
    offload = {
        "offload-colocated": Deployment(pd=False, offload=native()),
        "offload-pd": Deployment(pd=True, prefill_offload=native()),
        # Prefill gives the store 256 MiB; decode only uses it (a 0-byte segment) and,
        # by the builder's default, saves its decode-phase KV there, so the next
        # turn's prefill loads the previous turn's completion from it.
        "mooncake-pd": mooncake_pd(),
    }
    if group in offload:
        return ClusterSpec(models["base"], deployment=offload[group],
                           offload_num_blocks=OFFLOAD_NUM_BLOCKS, **common)
    return ClusterSpec(models["base"], deployment=pd_chain, **common)


def print_table(results: list[Result]) -> None:
    header = (f"{'scenario':36} {'requests':>8} {'same tokens':>11} {'same rows':>9} "
              f"{'max|dlogprob|':>13} {'preempt':>7} {'P-1 flips':>9} {'loaded':>6} "
              f"{'withheld':>8} {'store errors':>12} {'row checks failed':>17} "
              f"{'recomputed loads':>16} {'decode hits':>11} {'rows loaded':>11} "
              f"{'leaked':>6} {'mismatches':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        n = len(r.outcomes)
        withheld = "-" if r.withheld_tokens is None else str(r.withheld_tokens)
        print(f"{r.scenario.name:36} {n:8d} {sum(o.tokens_equal for o in r.outcomes):11d} "
              f"{sum(o.rows_equal for o in r.outcomes):9d} "
              f"{max((o.max_logprob_delta for o in r.outcomes), default=0.0):13.2e} "
              f"{r.preemptions:7d} {r.overlap_flips:9d} {r.loaded_tokens:6d} {withheld:>8} "
              f"{r.store_errors:12d} {r.rows_check_failures:17d} {r.recovered_loads:16d} "
              f"{r.decode_hit_tokens:11d} {r.rows_loaded:11d} {r.leaked_state:6d} "
              f"{r.mismatches:10d}")
    for r in results:
        for note in dict.fromkeys(r.notes):
            print(f"  {r.scenario.name}: {note[:400]}")
        if r.failed_to_start:
            print(f"  {r.scenario.name}: deployment failed to start: {r.failed_to_start}")
        elif r.preemptions < r.scenario.min_preemptions:
            print(f"  {r.scenario.name}: expected at least {r.scenario.min_preemptions} decode "
                  f"preemption(s), saw {r.preemptions}")
        if r.loaded_tokens < r.scenario.min_loaded_tokens:
            print(f"  {r.scenario.name}: loaded {r.loaded_tokens} tokens from KV offload; "
                  "the scenario needs loads to prove anything")
        if r.load_ratio is not None and r.min_load_ratio:
            print(f"  {r.scenario.name}: loaded {r.loaded_tokens} tokens from KV offload, its "
                  f"twin without routed experts {r.loaded_tokens + (r.withheld_tokens or 0)}: "
                  f"ratio {r.load_ratio:.3f} (rows travel with the chunks; needs "
                  f">= {r.min_load_ratio})")
        if r.withheld_tokens is not None:
            print(f"  {r.scenario.name}: the subject counted {r.withheld_counted} "
                  f"withheld tokens ({WITHHELD_COUNTED}); its twin loaded "
                  f"{r.withheld_tokens} more than it did")
        if r.decode_hit_tokens < r.scenario.min_decode_hit_tokens:
            print(f"  {r.scenario.name}: decode took {r.decode_hit_tokens} tokens from its "
                  f"prefix cache; the scenario needs at least {r.scenario.min_decode_hit_tokens}")
        if r.prefills_used < r.scenario.min_prefills_used:
            print(f"  {r.scenario.name}: {r.prefills_used} prefill instance(s) served the "
                  f"prompts; the scenario needs {r.scenario.min_prefills_used}")
        if r.rows_check_failures:
            print(f"  {r.scenario.name}: {r.rows_check_failures} pulled block(s) brought rows "
                  f"that failed decode's check; {r.recovered_loads} load(s) recomputed")
        if r.leaked_state:
            print(f"  {r.scenario.name}: after every request finished the servers still "
                  f"hold state for {r.leaked_state} request(s) ({' + '.join(LEAK_GAUGES)})")
        if r.store_errors:
            print(f"  {r.scenario.name}: {r.store_errors} {STORE_ERROR} line(s) in the server "
                  "logs: a request needed rows of a block that has none")
        if r.expired_leases:
            print(f"  {r.scenario.name}: prefill released {r.expired_leases} request(s)' KV "
                  "on lease expiry before decode read it (decode may have read reused blocks)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="the short version run by make test")
    parser.add_argument("--fault", choices=FAULTS, help="plant a fault on the decode server")
    parser.add_argument("--workdir", type=Path, help="models and server logs (default: temp dir)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these scenario names (long-context, for GPU runs, "
                             "runs only when named)")
    parser.add_argument(
        "--pd-chain", metavar="FLAGS",
        help="run the P/D scenarios (groups base and preempt) with the chains "
             "`vllm kv-transfer-config "
             "--role prefill|decode FLAGS` prints, e.g. \"--decode-offload off "
             "--hisparse-host-pool-gib 64\" (default: NIXL alone)")
    parser.add_argument(
        "--model", type=Path,
        help="serve this model instead of the tiny random ones (runs only the scenarios "
             "that use the base model); a GPU run also passes --serve-args and "
             "--kv-buffer-device")
    parser.add_argument(
        "--serve-args", default=" ".join(CPU_SERVE_ARGS), metavar="ARGS",
        help="`vllm serve` arguments besides routed experts and the chain (default: "
             "%(default)s)")
    parser.add_argument("--kv-buffer-device", default="cpu",
                        help="NixlConnector kv_buffer_device (default: cpu)")
    parser.add_argument("--graphs", action="store_true",
                        help="serve without --enforce-eager (GPU runs: CUDA graphs as the "
                             "config resolves them)")
    parser.add_argument(
        "--rows-transfer", action="store_true",
        help="kv_transfer_config.enable_routed_experts_transfer: on both P/D roles, rows "
             "travel with the KV over NIXL and decode returns all of them; on a native "
             "offload, each chunk carries its rows and the subject must load at least "
             f"{MIN_LOAD_RATIO} of what its twin loads (default scenarios: P/D without "
             "offload, and the colocated offload)")
    parser.add_argument(
        "--rows-transfer-only-on", choices=("prefill", "decode"),
        help="a one-sided switch: enable_routed_experts_transfer on this P/D role only. "
             "Decode's NIXL handshake must refuse the peer with a message naming both "
             "sides' formats, so every request fails and the run exits non-zero (a "
             "negative control; the P/D scenarios, like --rows-transfer)")
    parser.add_argument(
        "--kv-load-failure-policy", choices=("recompute", "fail"),
        help="kv_transfer_config.kv_load_failure_policy on both P/D roles (default: the "
             "builder's)")
    parser.add_argument(
        "--router", choices=("pdproxy", "vllm-router"), default="pdproxy",
        help="what sits in front of P/D: our merging proxy (default) or the vllm-router "
             "binary in --vllm-pd-disaggregation mode (decode's response only; needs "
             "--rows-transfer for complete rows)")
    args = parser.parse_args(argv)
    if args.fault in ROWS_TRANSFER_FAULTS and not args.rows_transfer:
        parser.error(f"--fault {args.fault} plants a fault in the rows transfer: add "
                     "--rows-transfer")
    unwind_on_sigterm()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-fork-e2e-"))
    pool = REDUCED if args.reduced else FULL
    if args.only is not None:
        pool += LONG_CONTEXT  # only when named
    scenarios = [s for s in pool if args.only is None or s.name in args.only]
    if args.model is not None:
        scenarios = [s for s in scenarios if s.group != "e300"]
    if args.rows_transfer and args.rows_transfer_only_on:
        parser.error("--rows-transfer turns the switch on on both roles; "
                     "--rows-transfer-only-on on one: pass one of them")
    one_sided = args.rows_transfer_only_on is not None
    if one_sided and args.only is None:  # P/D, without offload
        scenarios = [s for s in scenarios if s.group in PD_GROUPS]
    elif args.rows_transfer and args.only is None:
        scenarios = [s for s in scenarios if s.group in ROWS_TRANSFER_GROUPS]
    groups = list(dict.fromkeys(s.group for s in scenarios))
    models = {"base": args.model or workdir / "tiny-moe", "e300": workdir / "tiny-moe-300"}
    if args.model is None:
        build(models["base"], num_experts=8, num_experts_per_tok=2, seed=0)
    if "e300" in groups:
        build(models["e300"], num_experts=300, num_experts_per_tok=2, seed=0)
    options = HarnessOptions(fault=args.fault, pd_chain=pd_deployment(args.pd_chain),
                             serve_args=tuple(shlex.split(args.serve_args)),
                             kv_buffer_device=args.kv_buffer_device,
                             enforce_eager=not args.graphs,
                             rows_transfer=args.rows_transfer,
                             rows_transfer_only_on=args.rows_transfer_only_on,
                             router=args.router,
                             kv_load_failure_policy=args.kv_load_failure_policy)
    mode = "rows with the KV" if args.rows_transfer else "rows merged by the proxy"
    if one_sided:
        mode = f"rows transfer switch on {args.rows_transfer_only_on} only"
    print(f"e2e: {len(scenarios)} scenarios in {len(groups)} deployment(s), block size "
          f"{BLOCK_SIZE}, P/D: {mode}, front: {args.router}, fault: {args.fault or 'none'}, "
          f"logs under {workdir}", flush=True)

    results: list[Result] = []
    start = time.monotonic()
    for group in groups:
        cluster = Cluster(_cluster_spec(group, models, options), logs=workdir / f"logs-{group}")
        try:
            startup = cluster.start()
        except (RuntimeError, TimeoutError) as exc:
            reason = str(exc).splitlines()[0]
            print(f"e2e: deployment {group!r} failed to start: {reason}", flush=True)
            results += [Result(s, failed_to_start=reason) for s in scenarios if s.group == group]
            continue
        roles = ", ".join(f"{name} {server.url}" for name, server in cluster.servers.items())
        proxy = f", proxy {cluster.proxy_url}" if cluster.proxy_process is not None else ""
        print(f"e2e: deployment {group!r} up in {startup:.0f} s ({roles}{proxy})", flush=True)
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
          "differing tokens or rows. loaded: tokens the server under test loaded from KV "
          "offload; withheld: tokens its twin without routed experts loaded beyond that (what "
          "the load limit and the cut kept local).")
    total = sum(r.mismatches for r in results)
    print(f"e2e: {len(results)} scenarios, {total} mismatches "
          f"({time.monotonic() - start:.0f} s, fault: {args.fault or 'none'})")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
