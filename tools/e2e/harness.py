"""The equivalence harness as a library: which scenarios run, on which deployment,
how each one is judged and how the results are printed.

`python -m tools.e2e` (__main__.py) is its command line: it parses the flags, then
calls `select_scenarios`, `build_models`, `run_groups` and `print_report` in that order.
A scenario's verdict is `Result.mismatches`; a run passes only when the sum over its
scenarios is 0.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.role_chains import Deployment

from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import ClusterSpec, mooncake_pd, native
from tools.e2e.readiness import REQUESTS_LOG, STALLS_LOG
from tools.e2e.readings import KV_USAGE, LEAK_GAUGES
from tools.e2e.compare import Outcome, compare, compare_with_oracle, hang_up, post
from tools.e2e.scenarios import (
    FULL,
    LONG_CONTEXT,
    REDUCED,
    Req,
    Scenario,
    prompt_ids,
)
from tools.testbed.cpu_server import ProcessOutlivedKill
from tools.testbed.stalls import STALL_REPORT_S, stall_report
from tools.testbed.tiny_moe import build

# The deployments of plain NIXL P/D (no KV offload).
PD_GROUPS = ("base", "preempt", "xpyd", "e300")
# What --routed-experts-transfer runs by default: P/D, and the native offload (colocated and on
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
LEAK_WAIT_S = 10.0  # a step's stats can reach /metrics just after its response
# Offload deployments: a KV cache of 8 blocks (256 tokens) beside a 64 MiB CPU tier,
# so a conversation's next turn finds its earlier blocks evicted by the others.
OFFLOAD_NUM_BLOCKS = 8

LEGEND = (
    "P-1 flips: rows at P - 1 where the decode instance's own forward chose other experts "
    "than prefill; the proxy kept prefill's row, as colocated serving computes it. Not a "
    "mismatch by itself: a decode computation that really diverged also shows up as "
    "differing tokens or rows. loaded: tokens the server under test loaded from KV "
    "offload; withheld: tokens its twin without routed experts loaded beyond that (what "
    "the load limit and the cut kept local).")


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
    # After an abort scenario: the servers whose KV cache is still in use (a fraction).
    held_kv: dict[str, float] = field(default_factory=dict)
    # Rows travel with the subject's offloaded chunks: its loads ÷ the twin's must reach
    # this (0: no such requirement).
    min_load_ratio: float = 0.0
    notes: list[str] = field(default_factory=list)

    failed_to_start: str | None = None
    # A process of the deployment still alive after SIGKILL (ProcessOutlivedKill).
    outlived_stop: str | None = None

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
        if self.held_kv:
            bad += 1  # aborted requests left KV blocks held: the cache shrinks for good
        if self.outlived_stop:
            bad += 1  # a server outlived SIGKILL: what runs next shares its host
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


@dataclass(frozen=True)
class HarnessOptions:
    """What every deployment of a run shares. `spec`: the command line's ClusterSpec
    settings (fault, serve args, rows transfer, router, ...), whose model and
    deployment each group replaces; `pd_chain`: the P/D groups' chains (None: NIXL
    alone)."""

    spec: ClusterSpec
    pd_chain: Deployment | None = None


# -- which scenarios, on which deployments -------------------------------------------


def select_scenarios(reduced: bool, only: list[str] | None, own_model: bool,
                     routed_experts_transfer: bool, one_sided: bool) -> list[Scenario]:
    """The scenarios a run covers. `only` names them (long-context runs only when
    named); `own_model`: a model other than the tiny ones (no e300 group); a one-sided
    switch runs plain P/D, --routed-experts-transfer the groups whose rows can travel."""
    pool = REDUCED if reduced else FULL
    if only is not None:
        pool += LONG_CONTEXT  # only when named
    scenarios = [s for s in pool if only is None or s.name in only]
    if own_model:
        scenarios = [s for s in scenarios if s.group != "e300"]
    if one_sided and only is None:  # P/D, without offload
        scenarios = [s for s in scenarios if s.group in PD_GROUPS]
    elif routed_experts_transfer and only is None:
        scenarios = [s for s in scenarios if s.group in ROWS_TRANSFER_GROUPS]
    return scenarios


# The groups served colocated (one subject beside its twin): a P/D shape does not
# apply to them.
COLOCATED_GROUPS = ("offload-colocated",)


def pd_only(scenarios: list[Scenario], named: bool) -> list[Scenario]:
    """The P/D scenarios, for a run with a P/D shape (TP, async scheduling). Scenarios
    the command line named must all be P/D: a colocated one is refused, not run in
    another shape than asked."""
    colocated = [s.name for s in scenarios if s.group in COLOCATED_GROUPS]
    if colocated and named:
        raise ValueError(f"--prefill-tp, --decode-tp and --async-scheduling shape the P/D "
                         f"roles; {', '.join(colocated)} is served colocated: leave it "
                         f"out of --only")
    return [s for s in scenarios if s.group not in COLOCATED_GROUPS]


def shape_label(prefill_tp: int, decode_tp: int, async_scheduling: bool) -> str:
    """The P/D roles' shape, for the run's first line."""
    scheduling = "async" if async_scheduling else "sync"
    return f"prefill TP {prefill_tp} -> decode TP {decode_tp}, {scheduling} scheduling"


def groups_of(scenarios: Iterable[Scenario]) -> list[str]:
    """The deployments the scenarios need, in first-use order."""
    return list(dict.fromkeys(s.group for s in scenarios))


def build_models(workdir: Path, model: Path | None, groups: list[str]) -> dict[str, Path]:
    """The model of each group, building the tiny random ones that are needed."""
    models = {"base": model or workdir / "tiny-moe", "e300": workdir / "tiny-moe-300"}
    if model is None:
        build(models["base"], num_experts=8, num_experts_per_tok=2, seed=0)
    if "e300" in groups:
        build(models["e300"], num_experts=300, num_experts_per_tok=2, seed=0)
    return models


def cluster_spec(group: str, models: dict[str, Path], options: HarnessOptions) -> ClusterSpec:
    """The deployment of `group`, with the run's shared settings."""
    base = replace(options.spec, model=models["base"])
    pd_chain = options.pd_chain or Deployment(pd=True)
    if group == "e300":
        return replace(options.spec, model=models["e300"], deployment=Deployment(pd=True))
    if group == "xpyd":
        return replace(base, deployment=pd_chain, num_prefill=2)
    if group == "preempt":
        return replace(base, deployment=pd_chain, decode_num_blocks=4)
    offload = {
        "offload-colocated": Deployment(pd=False, offload=native()),
        "offload-pd": Deployment(pd=True, prefill_offload=native()),
        # Prefill gives the store 256 MiB; decode only uses it (a 0-byte segment) and,
        # by the builder's default, saves its decode-phase KV there, so the next
        # turn's prefill loads the previous turn's completion from it.
        "mooncake-pd": mooncake_pd(),
    }
    if group in offload:
        return replace(base, deployment=offload[group], offload_num_blocks=OFFLOAD_NUM_BLOCKS)
    return replace(base, deployment=pd_chain)


def mode_label(routed_experts_transfer: bool,
               routed_experts_transfer_only_on: str | None) -> str:
    """How the P/D rows reach the client, for the run's first line."""
    if routed_experts_transfer_only_on is not None:
        return f"rows transfer switch on {routed_experts_transfer_only_on} only"
    return "rows with the KV" if routed_experts_transfer else "rows merged by the proxy"


# -- one scenario's requests ---------------------------------------------------------


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
    turns_sent: int = 0

    def body(self) -> dict[str, Any]:
        start = self.previous_end if self.req.prompt_start == "prev" else int(self.req.prompt_start)
        return _body(self.ids, self.req, min(start, len(self.ids)))


def _without_rows(body: dict[str, Any]) -> dict[str, Any]:
    """The body for the twin, a server without --enable-return-routed-experts: it
    refuses a routed_experts_prompt_start (HTTP 400) instead of ignoring it."""
    return {key: value for key, value in body.items()
            if key != "routed_experts_prompt_start"}


def _send_to_twin(cluster: Cluster, body: dict[str, Any], outcome: Outcome) -> None:
    """The same traffic to the twin (comparable loads); its failure is a problem."""
    twin_body = _without_rows(body)
    if cluster.spec.topology == "pd":  # a twin prefill: what the proxy sends prefill
        twin_body["max_tokens"] = 1
    twin = traced_post(cluster, "twin", cluster.servers["twin"].url, twin_body)
    if "error" in twin:
        outcome.problem = "; ".join(
            filter(None, [f"twin failed: {twin['error'][:300]}", outcome.problem]))


def _advance(scenario: Scenario, conversation: Conversation,
             reference: dict[str, Any]) -> None:
    """The conversation's next turn, from the reference's answer to this one."""
    if "error" in reference:
        conversation.done = True
        return
    completion = reference["choices"][0]["token_ids"]
    conversation.previous_end = len(conversation.ids) + len(completion) - 1
    if not scenario.resend:
        conversation.ids = conversation.ids + completion


def _turn(cluster: Cluster, scenario: Scenario,
          conversation: Conversation) -> Outcome | None:
    """One turn through the deployment, checked against the reference; None for a
    turn the client hangs up on (abort_first), which is not compared."""
    body = conversation.body()
    conversation.turns_sent += 1
    reference = reference_answer(cluster, body)
    if cluster.only_reference:  # recording the reference's answers: nothing to check
        _advance(scenario, conversation, reference)
        return None
    if scenario.abort_first and conversation.turns_sent == 1:
        hang_up(cluster.url, body)
        _advance(scenario, conversation, reference)
        return None
    label = "offload" if cluster.spec.topology == "colocated" else "P/D"
    margin = cluster.spec.rows_oracle_margin
    subject = traced_post(cluster, label, cluster.url, body)
    if margin is None:
        outcome = compare(subject, reference, scenario.expect_dtype, label)
    else:
        outcome = compare_with_oracle(subject, reference, cluster.spec.model,
                                      margin, scenario.expect_dtype, label)
    if "twin" in cluster.servers and scenario.twin:
        _send_to_twin(cluster, body, outcome)
    _advance(scenario, conversation, reference)
    return outcome


def reference_answer(cluster: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    """The reference's answer to `body`: asked now, or, in a reference-first run,
    recorded while the reference served alone (ClusterSpec.reference_first)."""
    answers = cluster.reference_answers
    key = json.dumps(body, sort_keys=True)
    if answers is None or cluster.only_reference:
        answer = traced_post(cluster, "reference", cluster.servers["reference"].url, body)
        if answers is not None:
            answers[key] = answer
        return answer
    if key not in answers:
        return {"error": "the reference, which served first, was not sent this request "
                         f"({len(body.get('prompt', ()))} prompt tokens): the deployment "
                         "was sent a turn the reference's answers do not lead to"}
    return answers[key]


def record_reference_answers(spec: ClusterSpec, scenarios: list[Scenario],
                             logs: Path) -> dict[str, dict[str, Any]]:
    """Serve the reference alone, send it every turn of `scenarios` as the checked
    run will, and return its answers by request body; the reference is stopped
    before this returns. Raises what Cluster.start and Cluster.stop raise."""
    answers: dict[str, dict[str, Any]] = {}
    cluster = Cluster(spec, logs=logs, reference_answers=answers, only_reference=True)
    startup = cluster.start()
    start = time.monotonic()
    try:
        for scenario in scenarios:
            _send_all(cluster, scenario, _conversations(scenario))
    finally:
        cluster.stop()
    print(f"e2e: the reference (up in {startup:.0f} s) answered {len(answers)} "
          f"distinct requests in {time.monotonic() - start:.0f} s and stopped before "
          "the deployment starts", flush=True)
    return answers


def _report_stall(cluster: Cluster, who: str, tokens: int) -> None:
    """A request has waited STALL_REPORT_S: what every thread on the host does now,
    appended to the deployment's stalls.log (tools/testbed/stalls.py)."""
    report = stall_report(cluster.process_owners())
    with (cluster.logs / STALLS_LOG).open("a") as log:
        log.write(f"{time.strftime('%H:%M:%S')} a request to {who} ({tokens} prompt "
                  f"tokens) has waited {STALL_REPORT_S:.0f} s; {report}\n")
    print(f"e2e:   a request to {who} has waited {STALL_REPORT_S:.0f} s: what the "
          f"host's threads did is in {cluster.logs / STALLS_LOG}", flush=True)


def traced_post(cluster: Cluster, who: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """`post`, with its start and end written to the deployment's requests.log (wall
    clock, as vLLM's logs print it), so that a slow or stuck run can be read against
    the servers' logs afterwards."""
    tokens = len(body.get("prompt", ()))
    with (cluster.logs / REQUESTS_LOG).open("a") as log:
        log.write(f"{time.strftime('%H:%M:%S')} -> {who}: {tokens} prompt tokens, "
                  f"max_tokens {body.get('max_tokens')}\n")
    start = time.monotonic()
    watch = threading.Timer(STALL_REPORT_S, _report_stall, (cluster, who, tokens))
    watch.daemon = True
    watch.start()
    try:
        answer = post(url, body)
    finally:
        watch.cancel()
    outcome = "ok" if "error" not in answer else str(answer["error"])[:200]
    with (cluster.logs / REQUESTS_LOG).open("a") as log:
        log.write(f"{time.strftime('%H:%M:%S')} <- {who}: {outcome} in "
                  f"{time.monotonic() - start:.1f} s\n")
    return answer


def _run_conversation(cluster: Cluster, scenario: Scenario,
                      conversation: Conversation) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for _turn_index in range(scenario.turns):
        if conversation.done:
            break
        if (outcome := _turn(cluster, scenario, conversation)) is not None:
            outcomes.append(outcome)
    return outcomes


def _send_all(cluster: Cluster, scenario: Scenario,
              conversations: list[Conversation]) -> list[Outcome]:
    """Every turn of every conversation: turn-major one at a time (interleave), or
    each conversation on its own thread."""
    outcomes: list[Outcome] = []
    if scenario.interleave:
        for _turn_index in range(scenario.turns):
            for conversation in conversations:
                if conversation.done:
                    continue
                if (outcome := _turn(cluster, scenario, conversation)) is not None:
                    outcomes.append(outcome)
        return outcomes
    with ThreadPoolExecutor(max_workers=scenario.concurrency) as pool:
        futures = [pool.submit(_run_conversation, cluster, scenario, c)
                   for c in conversations]
        for future in futures:
            outcomes.extend(future.result())
    return outcomes


# -- the servers' counters around a scenario -----------------------------------------


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


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What each counter grew by; 0 where a metric is missing (-1) on either side."""
    return {key: max(after[key] - before[key], 0) if min(after[key], before[key]) >= 0 else 0
            for key in before}


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


def held_kv_blocks(cluster: Cluster, wait_s: float = LEAK_WAIT_S) -> dict[str, float]:
    """The servers whose KV cache is still in use (vllm:kv_cache_usage_perc > 0),
    once every one reads 0 or after ``wait_s``: every request has finished, and
    a finished request's blocks are free once its KV stores and transfers are done
    (cached blocks count as free), so what is left is held by a leak."""
    deadline = time.monotonic() + wait_s
    while True:
        held = {name: usage for name in cluster.servers
                if (usage := cluster.gauge(name, KV_USAGE) or 0.0) > 0}
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(0.5)


def _record_counters(result: Result, cluster: Cluster, delta: dict[str, int]) -> None:
    result.preemptions = delta["preemptions"]
    result.overlap_flips = delta["flips"]
    result.expired_leases = delta["expired"]
    result.loaded_tokens = delta["loaded"] if cluster.spec.roles_with_offload else 0
    if "twin" in cluster.servers and result.scenario.twin:
        result.withheld_tokens = delta["twin_loaded"] - delta["loaded"]
        result.withheld_counted = delta["withheld_counted"]
        if cluster.spec.routed_experts_transfer:
            result.min_load_ratio = MIN_LOAD_RATIO
    result.store_errors = delta["store_errors"]
    result.rows_check_failures = delta["rows_check_failures"]
    result.rows_loaded = delta["rows_loaded"]
    result.leaked_state = leaked_state(cluster)
    if result.scenario.abort_first:
        result.held_kv = held_kv_blocks(cluster)
    result.recovered_loads = delta["recovered_loads"]
    result.decode_hit_tokens = delta["decode_hits"]
    result.prefills_used = sum(delta[f"prompt_tokens:{name}"] > 0
                               for name in cluster.prefill_names)


def _conversations(scenario: Scenario) -> list[Conversation]:
    return [Conversation(req, prompt_ids(scenario.seed, i, req.prompt_len))
            for i, req in enumerate(scenario.requests)]


def run_scenario(cluster: Cluster, scenario: Scenario) -> Result:
    result = Result(scenario)
    subject = "subject" if cluster.spec.topology == "colocated" else "prefill"
    before = _counters(cluster, subject)
    result.outcomes.extend(_send_all(cluster, scenario, _conversations(scenario)))
    _record_counters(result, cluster, _delta(before, _counters(cluster, subject)))
    for outcome in result.outcomes:
        if outcome.problem:
            result.notes.append(outcome.problem)
    return result


def _near_ties(result: Result) -> str:
    """", N rows at near-ties (largest gap G)" when rows were checked against the
    transformers oracle and some differed only by a near-tie."""
    ties = sum(o.near_ties for o in result.outcomes)
    gaps = [o.largest_near_tie_gap for o in result.outcomes
            if o.largest_near_tie_gap is not None]
    if not ties:
        return ""
    return f", {ties} rows differ from transformers only at near-ties (largest gap {max(gaps):.4g})"


# -- a run: every group's deployment, its scenarios ----------------------------------


def run_group(group: str, scenarios: list[Scenario], models: dict[str, Path],
              options: HarnessOptions, workdir: Path) -> list[Result]:
    """Start the group's deployment, run its scenarios, stop it. A deployment that
    does not start fails each of its scenarios."""
    mine = [s for s in scenarios if s.group == group]
    spec = cluster_spec(group, models, options)
    logs = workdir / f"logs-{group}"
    cluster = Cluster(spec, logs=logs)
    try:
        if spec.reference_first:
            cluster.reference_answers = record_reference_answers(spec, mine, logs)
        startup = cluster.start()
    except (RuntimeError, TimeoutError, ProcessOutlivedKill) as exc:
        reason = str(exc).splitlines()[0]
        print(f"e2e: deployment {group!r} failed to start: {reason}", flush=True)
        return [Result(s, failed_to_start=reason) for s in mine]
    roles = ", ".join(f"{name} {server.url}" for name, server in cluster.servers.items())
    proxy = f", proxy {cluster.proxy_url}" if cluster.proxy_process is not None else ""
    again = f" after {cluster.restarts} restart" if cluster.restarts else ""
    print(f"e2e: deployment {group!r} up in {startup:.0f} s{again} ({roles}{proxy})",
          flush=True)
    results: list[Result] = []
    try:
        for scenario in mine:
            result = run_scenario(cluster, scenario)
            results.append(result)
            print(f"e2e: {scenario.name}: {len(result.outcomes)} requests, "
                  f"{result.mismatches} mismatches{_near_ties(result)}", flush=True)
    finally:
        stopped = time.monotonic()
        try:
            cluster.stop()
        except ProcessOutlivedKill as exc:
            # The table still gets printed: the rows were checked; the host was not
            # left clean, which fails the group's scenarios.
            print(f"e2e: deployment {group!r} did not stop: {exc}", flush=True)
            for result in results:
                result.outlived_stop = str(exc)
        print(f"e2e: deployment {group!r} stopped in "
              f"{time.monotonic() - stopped:.0f} s", flush=True)
    return results


def run_groups(scenarios: list[Scenario], models: dict[str, Path], options: HarnessOptions,
               workdir: Path) -> list[Result]:
    results: list[Result] = []
    for group in groups_of(scenarios):
        results += run_group(group, scenarios, models, options, workdir)
    return results


def total_mismatches(results: Iterable[Result]) -> int:
    return sum(r.mismatches for r in results)


# -- the report ----------------------------------------------------------------------


def _table_header() -> str:
    return (f"{'scenario':36} {'requests':>8} {'same tokens':>11} {'same rows':>9} "
            f"{'max|dlogprob|':>13} {'preempt':>7} {'P-1 flips':>9} {'loaded':>6} "
            f"{'withheld':>8} {'store errors':>12} {'row checks failed':>17} "
            f"{'recomputed loads':>16} {'decode hits':>11} {'rows loaded':>11} "
            f"{'leaked':>6} {'mismatches':>10}")


def _table_row(r: Result) -> str:
    n = len(r.outcomes)
    withheld = "-" if r.withheld_tokens is None else str(r.withheld_tokens)
    return (f"{r.scenario.name:36} {n:8d} {sum(o.tokens_equal for o in r.outcomes):11d} "
            f"{sum(o.rows_equal for o in r.outcomes):9d} "
            f"{max((o.max_logprob_delta for o in r.outcomes), default=0.0):13.2e} "
            f"{r.preemptions:7d} {r.overlap_flips:9d} {r.loaded_tokens:6d} {withheld:>8} "
            f"{r.store_errors:12d} {r.rows_check_failures:17d} {r.recovered_loads:16d} "
            f"{r.decode_hit_tokens:11d} {r.rows_loaded:11d} {r.leaked_state:6d} "
            f"{r.mismatches:10d}")


def _start_and_load_notes(r: Result) -> list[str]:
    notes: list[str] = []
    if r.failed_to_start:
        notes.append(f"deployment failed to start: {r.failed_to_start}")
    elif r.preemptions < r.scenario.min_preemptions:
        notes.append(f"expected at least {r.scenario.min_preemptions} decode "
                     f"preemption(s), saw {r.preemptions}")
    if r.loaded_tokens < r.scenario.min_loaded_tokens:
        notes.append(f"loaded {r.loaded_tokens} tokens from KV offload; "
                     "the scenario needs loads to prove anything")
    if r.load_ratio is not None and r.min_load_ratio:
        notes.append(f"loaded {r.loaded_tokens} tokens from KV offload, its "
                     f"twin without routed experts {r.loaded_tokens + (r.withheld_tokens or 0)}: "
                     f"ratio {r.load_ratio:.3f} (rows travel with the chunks; needs "
                     f">= {r.min_load_ratio})")
    if r.withheld_tokens is not None:
        notes.append(f"the subject counted {r.withheld_counted} "
                     f"withheld tokens ({WITHHELD_COUNTED}); its twin loaded "
                     f"{r.withheld_tokens} more than it did")
    return notes


def _server_state_notes(r: Result) -> list[str]:
    notes: list[str] = []
    if r.decode_hit_tokens < r.scenario.min_decode_hit_tokens:
        notes.append(f"decode took {r.decode_hit_tokens} tokens from its "
                     f"prefix cache; the scenario needs at least {r.scenario.min_decode_hit_tokens}")
    if r.prefills_used < r.scenario.min_prefills_used:
        notes.append(f"{r.prefills_used} prefill instance(s) served the "
                     f"prompts; the scenario needs {r.scenario.min_prefills_used}")
    if r.rows_check_failures:
        notes.append(f"{r.rows_check_failures} pulled block(s) brought rows "
                     f"that failed decode's check; {r.recovered_loads} load(s) recomputed")
    if r.leaked_state:
        notes.append(f"after every request finished the servers still "
                     f"hold state for {r.leaked_state} request(s) ({' + '.join(LEAK_GAUGES)})")
    if r.outlived_stop:
        notes.append(f"the deployment did not stop: {r.outlived_stop}")
    if r.held_kv:
        held = ", ".join(f"{name} {usage:.2%}" for name, usage in r.held_kv.items())
        notes.append(f"after every request finished, KV blocks are still held "
                     f"({KV_USAGE}: {held})")
    if r.store_errors:
        notes.append(f"{r.store_errors} {STORE_ERROR} line(s) in the server "
                     "logs: a request needed rows of a block that has none")
    if r.expired_leases:
        notes.append(f"prefill released {r.expired_leases} request(s)' KV "
                     "on lease expiry before decode read it (decode may have read reused blocks)")
    return notes


def result_notes(r: Result) -> list[str]:
    """What the table row does not say about a scenario, one line each."""
    problems = [note[:400] for note in dict.fromkeys(r.notes)]
    return problems + _start_and_load_notes(r) + _server_state_notes(r)


def print_table(results: list[Result]) -> None:
    header = _table_header()
    print(header)
    print("-" * len(header))
    for r in results:
        print(_table_row(r))
    for r in results:
        for note in result_notes(r):
            print(f"  {r.scenario.name}: {note}")


def print_report(results: list[Result], elapsed_s: float, fault: str | None) -> int:
    """The table, its legend and the summary line (last); the run's exit code."""
    print()
    print_table(results)
    print(LEGEND)
    total = total_mismatches(results)
    print(f"e2e: {len(results)} scenarios, {total} mismatches "
          f"({elapsed_s:.0f} s, fault: {fault or 'none'})")
    return 0 if total == 0 else 1
