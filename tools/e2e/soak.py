"""Soak: a seeded random workload on 1P1D under faults, checked against colocated serving.

    python -m tools.e2e.soak [--requests N] [--seed S] [--concurrency C]
                             [--group-size N]
                             [--faults decode-kill,prefill-kill,mooncake-restart]
                             [--mode rows-over-nixl|proxy-merge]
                             [--fault NAME] [--workdir DIR]

A P/D pair of the installed fork over NIXL (prefill, decode with a small KV cache so
requests are preempted, `kv_load_failure_policy=recompute` on both, a 120 s NIXL lease)
behind the P/D proxy, and a colocated reference server, on the harness's tiny MoE.
`--mode rows-over-nixl` (default) builds both roles with `--routed-experts-transfer`,
so decode returns every row; `--mode proxy-merge` leaves it off and the proxy merges
the halves.

The workload, seeded (the same requests every run; the fault timing is not): prompt
lengths 1-512, completions 1-32, every kind of `routed_experts_prompt_start` (0, on a
block boundary, mid-block, the whole prompt, the previous turn's P + C - 1),
conversations of 1-3 turns whose next turn extends the previous prompt and completion
(multi-turn reuse), `concurrency` clients at once, and client aborts: a stream closed
after its first chunk, or a request whose client gives up after a fraction of a second.
Mixed in, RL groups (`--group-size N`, default 4; 0 for none): about 15 % of the
conversations are instead one request with `n = N` and seeded non-greedy sampling
(temperature, top_p, top_k, seed), otherwise drawn as a first turn is (prompt, completion
length, start, client abort). Under P/D it is prefilled once and its hand-off read once
by decode's children (docs/deployment-shapes.md, "Parallel sampling (`n > 1`) under
P/D"); both modes serve it. The single requests are the same whatever the group size.
Every completed response is compared with the reference's (tokens and rows, by
position); a group's choice by choice by `index` (vLLM gives child i the seed
`seed + i`, so the reference draws the same choice i), and one differing choice makes
the group a mismatch. An aborted request, group or not, is not compared.

Faults during the run (`--faults`), the k-th of n when k / (n + 1) of the requests were
sent: `decode-kill` SIGKILLs decode's whole process group and restarts it;
`prefill-kill` does the same to prefill, while requests are between hand-off and read;
`mooncake-restart` stops the Mooncake master and starts it again on the same ports (the
deployment then has the Mooncake store: prefill's chain gives it a segment, decode's
uses it and saves its decode KV there). A request that meets a fault may fail, with an
HTTP error that says what happened; it must never complete with a wrong answer. The
master restart must also leave both servers in the processes they had, and the store
must serve loads again afterwards (prefill loads tokens from it).

At the end, once both servers are idle: the fork's per-request gauges
(`vllm:routed_experts_tracked_requests`, `vllm:routed_experts_emit_floors`), requests
still running or waiting, the KV blocks prefill still holds for decode (NIXL leases) and
the KV cache decode still uses (a group's pinned hand-off) must all be 0, waited for
until a lease can have run out. One table: requests sent, completed equal to the
reference, failed with a clear error, client aborts, group requests sent and equal,
mismatches, server memory (RSS) at start and end, leaked state. Exit 0 only with 0
mismatches, 0 leaks, no unclear failure, and at least half of the requests that were
not aborted completed. With --fault (a planted fault on decode, as in
`python -m tools.e2e`) the run must exit 1: the negative control.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from vllm.distributed.kv_transfer.role_chains import Deployment

from tools.testbed.aliases import PROXY_MERGE, ROWS_OVER_NIXL, deprecated_values
from tools.testbed.metrics import read_total
from tools.testbed.tiny_moe import build
from tools.e2e import fault_registry
from tools.e2e.cluster import Cluster, unwind_on_sigterm
from tools.e2e.cluster_spec import CPU_SERVE_ARGS, ClusterSpec, mooncake_pd
from tools.e2e.readings import KV_USAGE, LEAK_GAUGES
from tools.e2e.compare import compare, compare_group, hang_up, post
from tools.e2e.pd_pair import kill_server
from tools.e2e.scenarios import BLOCK_SIZE, prompt_ids

MAX_PROMPT, MAX_COMPLETION = 512, 32
MAX_MODEL_LEN = 640  # the longest prompt (512) and completion (32) fit, with room
# 1,024 tokens (the tiny model's longest context): under two of the longest requests;
# eight clients at once preempt each other.
DECODE_NUM_BLOCKS = 33
LEASE_SECONDS = 120
FAULTS = ("decode-kill", "prefill-kill", "mooncake-restart")
DEFAULT_FAULTS = ",".join(FAULTS)
# How long the store may take to serve a load again after its master restarted. The
# restarted master refuses service for about 30 s and the clients remount their
# segments with their heartbeat (measured here: a request stalled 89 s).
STORE_RECOVERY_SECONDS = 900
# The fork's per-request state on a server (docs/metrics.md): 0 once everything finished.
BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# Finished requests whose blocks a KV transfer holds (prefill: NIXL leases).
KV_HELD = "vllm:kv_transfer_held_requests"
KV_LOAD_FAILED = "vllm:kv_load_failed_requests_total"
ROWS_LOADED = "vllm:routed_experts_rows_loaded_total"
PREEMPTIONS = "vllm:num_preemptions_total"
# Tokens a KV connector loaded: on prefill only the store loads; on decode, NIXL too.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
COUNTERS = (KV_LOAD_FAILED, ROWS_LOADED, PREEMPTIONS, EXTERNAL_HITS)
ABORT_AFTER_S = 0.4  # how long an impatient client waits before it hangs up
# RL groups: one conversation in GROUP_SHARE is a single request with n = --group-size,
# seeded and sampled. Drawn from their own random stream, so the single requests of the
# other conversations are the same whatever the group size (0: none, the plan before
# groups).
DEFAULT_GROUP_SIZE = 4
GROUP_SHARE = 0.15
GROUP_TEMPERATURES = (0.6, 0.8, 1.0)
GROUP_TOP_PS = (1.0, 0.95, 0.8)
GROUP_TOP_KS = (-1, 5, 20)  # -1: no top-k


@dataclass(frozen=True)
class Turn:
    """One request of a conversation; `start` is an int or "prev" (P + C - 1 of the
    previous turn)."""

    extra_prompt: int  # tokens appended to the conversation so far (turn 1: the prompt)
    max_tokens: int
    start: int | str
    abort: str | None = None  # None, "stream" or "timeout"
    n: int = 1  # > 1: an RL group, n completions of the prompt
    # A group's seeded non-greedy sampling ((name, value) pairs); a single request is
    # greedy.
    sampling: tuple[tuple[str, float | int], ...] = ()


def plan_conversation(seed: int, index: int) -> list[Turn]:
    """The seeded turns of conversation `index`: every kind of start, some aborts."""
    rng = random.Random(seed * 7919 + index)
    turns: list[Turn] = []
    length = 0
    for turn in range(rng.choice((1, 1, 1, 2, 3))):
        budget = MAX_PROMPT - length
        if budget < 1:
            break
        if turn:
            extra = rng.randint(1, min(64, budget))
        else:  # a quarter of the prompts long, the rest up to half the longest
            extra = rng.randint(1, MAX_PROMPT if rng.random() < 0.25 else MAX_PROMPT // 2)
        length += extra
        kind = rng.choice(("zero", "boundary", "mid", "whole", "prev" if turn else "zero"))
        start: int | str
        if kind == "boundary":
            start = (length // BLOCK_SIZE) * BLOCK_SIZE
        elif kind == "mid":
            start = rng.randint(0, length)
        elif kind == "whole":
            start = length
        elif kind == "prev":
            start = "prev"
        else:
            start = 0
        abort = rng.choices((None, "stream", "timeout"), weights=(85, 8, 7))[0]
        turns.append(Turn(extra, rng.randint(1, MAX_COMPLETION), start, abort))
        length += turns[-1].max_tokens  # the next turn carries this completion
    return turns


def plan_group(seed: int, index: int, group_size: int) -> Turn | None:
    """Conversation `index` as an RL group, or None when it stays a conversation of
    single requests (about GROUP_SHARE of them are groups; none below a size of 2). A
    group is one request: the prompt, completion length, start and client abort of the
    conversation's first turn, with `n = group_size` and seeded non-greedy sampling
    (temperature, top_p, top_k, seed)."""
    if group_size < 2:
        return None
    rng = random.Random((seed * 6271 + index) * 2 + 1)  # apart from plan_conversation's
    if rng.random() >= GROUP_SHARE:
        return None
    sampling = (("temperature", rng.choice(GROUP_TEMPERATURES)),
                ("top_p", rng.choice(GROUP_TOP_PS)),
                ("top_k", rng.choice(GROUP_TOP_KS)),
                ("seed", rng.randrange(1 << 30)))
    return replace(plan_conversation(seed, index)[0], n=group_size, sampling=sampling)


def plan(seed: int, num_requests: int, group_size: int = 0) -> list[list[Turn]]:
    """`num_requests` turns in conversations; with `group_size` >= 2 some
    conversations are one group request instead (plan_group)."""
    conversations: list[list[Turn]] = []
    total = 0
    while total < num_requests:
        index = len(conversations)
        group = plan_group(seed, index, group_size)
        turns = ([group] if group else plan_conversation(seed, index))[: num_requests - total]
        conversations.append(turns)
        total += len(turns)
    return conversations


@dataclass
class Tally:
    """What happened to the requests; `classify` files each one."""

    sent: int = 0
    equal: int = 0
    groups: int = 0  # of `sent`: group requests (n > 1), aborted ones too
    groups_equal: int = 0  # of `equal`: groups whose every choice equals the reference's
    failed_clearly: int = 0
    aborted: int = 0
    mismatches: list[str] = field(default_factory=list)
    unclear: list[str] = field(default_factory=list)
    failure_kinds: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Cleared while a killed server restarts: clients hold their next request, as a
    # router holds traffic for a dead instance; the requests in flight meet the fault.
    serving: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.serving.set()

    @property
    def not_aborted(self) -> int:
        return self.sent - self.aborted


def clear_error(error: str) -> bool:
    """An error a client can act on: an HTTP status with a message, or a connection
    that could not be made (the front end itself was down)."""
    if error.startswith("HTTP "):
        status, _, message = error.partition(": ")
        return len(message.strip()) > 2 and status[5:8].isdigit()
    return error.startswith(("URLError", "ConnectionRefusedError", "RemoteDisconnected"))


def classify(tally: Tally, label: str, front: dict[str, Any], reference: dict[str, Any],
             n: int = 1) -> None:
    """File one completed (not aborted) request; with `n` > 1 a group, compared with
    the reference choice by choice by index (a group with one differing choice is one
    mismatch)."""
    with tally.lock:
        tally.sent += 1
        tally.groups += n > 1
        if "error" in front:
            if clear_error(front["error"]):
                tally.failed_clearly += 1
                tally.failure_kinds[front["error"][:60]] += 1
            else:
                tally.unclear.append(f"{label}: {front['error'][:300]}")
            return
        outcome = compare_group(front, reference, n) if n > 1 else compare(front, reference)
        if outcome.problem:
            tally.mismatches.append(f"{label}: {outcome.problem[:300]}")
        else:
            tally.equal += 1
            tally.groups_equal += n > 1


def body(ids: list[int], turn: Turn, start: int) -> dict[str, Any]:
    """The /v1/completions body of `turn`: greedy, or for a group `n` and its seeded
    sampling."""
    sampling = {"n": turn.n, **dict(turn.sampling)} if turn.n > 1 else {"temperature": 0}
    return {"model": "tiny", "prompt": ids, "max_tokens": turn.max_tokens,
            **sampling, "ignore_eos": True, "return_token_ids": True,
            "routed_experts_prompt_start": start}


def run_conversation(cluster: Cluster, seed: int, index: int, turns: list[Turn],
                     tally: Tally) -> None:
    reference = cluster.servers["reference"].url
    ids = prompt_ids(seed, index, turns[0].extra_prompt)
    previous_end = 0
    for number, turn in enumerate(turns):
        if number:
            ids = ids + prompt_ids(seed + 1, index * 10 + number, turn.extra_prompt)
        start = previous_end if turn.start == "prev" else int(turn.start)
        start = min(start, len(ids))
        request = body(ids, turn, start)
        tally.serving.wait()
        want = post(reference, request)
        label = f"conversation {index} turn {number + 1} (P={len(ids)}, s={start}, " \
                f"C={turn.max_tokens}{f', n={turn.n}' if turn.n > 1 else ''})"
        if turn.abort:
            hang_up(cluster.url, request, turn.abort, ABORT_AFTER_S)
            with tally.lock:
                tally.sent += 1
                tally.aborted += 1
                tally.groups += turn.n > 1
        else:
            classify(tally, label, post(cluster.url, request), want, turn.n)
        if "error" in want:  # the reference must answer: its failure is the soak's
            with tally.lock:
                tally.unclear.append(f"{label}: reference failed: {want['error'][:300]}")
            return
        completion = want["choices"][0]["token_ids"]
        previous_end = len(ids) + len(completion) - 1
        ids = ids + completion


def server_rss(cluster: Cluster) -> dict[str, int]:
    """Resident memory of each server's process tree (API server, engine core)."""
    out = {}
    for name in ("prefill", "decode"):
        process = cluster.servers[name].process
        total = 0
        if process is not None and process.poll() is None:
            with_children = psutil.Process(process.pid)
            for member in (with_children, *with_children.children(recursive=True)):
                try:
                    total += member.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        out[name] = total
    return out


def restart(cluster: Cluster, name: str, tally: Tally, events: list[str],
            carried: dict[str, dict[str, float]]) -> None:
    """SIGKILL a server's process group with requests in flight and start it again on
    the same ports (its new log beside the old one); clients hold new requests until it
    is back. Its counters so far are added to `carried` (the new process starts at 0)."""
    url = cluster.servers[name].url
    for metric, value in gauges(url, COUNTERS).items():
        carried[name][metric] = carried[name].get(metric, 0.0) + value
    tally.serving.clear()
    began = time.monotonic()
    in_flight = tally.sent
    kill_server(cluster, name)
    server = cluster.servers[name]
    server.log_path = server.log_path.with_name(f"{name}-restarted-{len(events)}.log")
    server.start()
    server.wait_ready(timeout=600)
    tally.serving.set()
    events.append(f"{name} killed (SIGKILL) after {in_flight} requests and back in "
                  f"{time.monotonic() - began:.0f} s")


def server_pids(cluster: Cluster) -> dict[str, int | None]:
    """Each server's API process id, None when it is not running."""
    out: dict[str, int | None] = {}
    for name in ("prefill", "decode"):
        process = cluster.servers[name].process
        out[name] = process.pid if process is not None and process.poll() is None else None
    return out


def store_loads(cluster: Cluster, carried: dict[str, dict[str, float]]) -> float:
    """Tokens prefill has loaded from the store, over its restarts."""
    url = cluster.servers["prefill"].url
    return read_total(url, EXTERNAL_HITS) + carried["prefill"].get(EXTERNAL_HITS, 0.0)


def restart_store(cluster: Cluster, tally: Tally, events: list[str],
                  carried: dict[str, dict[str, float]], problems: list[str],
                  done: threading.Event, recovery_seconds: float = STORE_RECOVERY_SECONDS,
                  ) -> None:
    """Stop the Mooncake master with requests in flight and start it on the same ports;
    traffic goes on. Then wait until prefill loads from the store again: every object
    the old master knew is gone, so that load is of a chunk stored after the restart.
    Both servers must keep their processes throughout."""
    assert cluster.master is not None, "mooncake-restart needs the store in the deployment"
    pids = server_pids(cluster)
    loads = store_loads(cluster, carried)
    in_flight = tally.sent
    began = time.monotonic()
    cluster.master.stop()
    cluster.master.start()
    down = time.monotonic() - began
    deadline = began + recovery_seconds
    while not (recovered := store_loads(cluster, carried) > loads):
        if done.is_set() or time.monotonic() > deadline:
            break
        time.sleep(2)
    waited = time.monotonic() - began
    events.append(
        f"mooncake master restarted after {in_flight} requests (down {down:.0f} s); "
        + (f"prefill loaded from the store again {waited:.0f} s later" if recovered else
           f"prefill loaded nothing from the store in the {waited:.0f} s after it"))
    if not recovered:
        problems.append(
            f"the Mooncake store served no load in the {waited:.0f} s after its master "
            "restarted (prefill's store loads stayed at "
            f"{loads:g} tokens; its log says why)")
    after = server_pids(cluster)
    if after != pids:
        problems.append(f"a server lost its process while the Mooncake master restarted: "
                        f"process ids {pids} before, {after} after")


def inject_faults(cluster: Cluster, faults: list[str], total: int, tally: Tally,
                  events: list[str], carried: dict[str, dict[str, float]],
                  problems: list[str], done: threading.Event) -> None:
    """Each fault when its share of the requests has been sent: the k-th of n at
    k / (n + 1) of `total`."""
    for number, fault in enumerate(faults, start=1):
        threshold = total * number // (len(faults) + 1)
        while tally.sent < threshold and not done.is_set():
            time.sleep(0.2)
        if done.is_set():
            events.append(f"{fault} not injected: the workload ended first")
            return
        if fault == "mooncake-restart":
            restart_store(cluster, tally, events, carried, problems, done)
        else:
            restart(cluster, fault.split("-")[0], tally, events, carried)


def gauges(url: str, names: tuple[str, ...]) -> dict[str, float]:
    return {name: read_total(url, name) for name in names}


def leaked_state(cluster: Cluster, lease_seconds: float) -> dict[str, float]:
    """Per server: requests still busy, the fork's per-request gauges, held KV and
    the KV cache in use, once they read 0 or the waits run out. Prefill holds the
    blocks of a hand-off decode never read (an aborted or failed request) until its
    lease runs out, and decode drops a group's pin on a landed hand-off within one
    lease too, so that wait covers one lease."""
    deadline = time.monotonic() + 60
    found: dict[str, float] = {}
    while True:
        found = {f"{name} {gauge}": value for name in ("prefill", "decode")
                 for gauge, value in gauges(cluster.servers[name].url,
                                            BUSY_GAUGES + LEAK_GAUGES).items() if value}
        if not found or time.monotonic() > deadline:
            break
        time.sleep(2)
    prefill = cluster.servers["prefill"].url
    deadline = time.monotonic() + lease_seconds + 30
    while True:
        held = {f"{name} {KV_HELD} (KV held for a transfer)": value
                for name in ("prefill", "decode")
                if (value := read_total(cluster.servers[name].url, KV_HELD))}
        if (usage := read_total(prefill, KV_USAGE)):
            held[f"prefill {KV_USAGE} (KV held for decode)"] = usage
        # Decode pins a group's landed hand-off for the children still to take it;
        # every pin is dropped once they all did or finished, or after one lease.
        if (usage := read_total(cluster.servers["decode"].url, KV_USAGE)):
            held[f"decode {KV_USAGE} (KV pinned for a group, or held)"] = usage
        if not held or time.monotonic() > deadline:
            break
        time.sleep(5)
    return found | held


def soak(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    faults = [f for f in args.faults.split(",") if f]
    spec = ClusterSpec(
        model, deployment=soak_deployment(faults, args.store),
        decode_num_blocks=DECODE_NUM_BLOCKS,
        routed_experts_transfer=args.mode == ROWS_OVER_NIXL,
        kv_load_failure_policy="recompute",
        kv_lease_seconds=args.lease, fault=args.fault,
        serve_args=(*CPU_SERVE_ARGS, "--max-model-len", str(MAX_MODEL_LEN)))
    cluster = Cluster(spec, workdir / "logs")
    conversations = plan(args.seed, args.requests, args.group_size)
    groups = sum(turn.n > 1 for turns in conversations for turn in turns)
    mix = f"{groups} of them groups of n = {args.group_size}" if groups else "no groups"
    print(f"soak: {args.requests} requests in {len(conversations)} conversations "
          f"({mix}), seed "
          f"{args.seed}, concurrency {args.concurrency}, mode {args.mode}, faults "
          f"{faults or 'none'}, planted fault {args.fault or 'none'}, logs under {workdir}",
          flush=True)
    tally, events, problems = Tally(), [], []
    began = time.monotonic()
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError) as exc:
            print(f"soak: the deployment did not start: {exc}", flush=True)
            return 1
        urls = {name: cluster.servers[name].url for name in ("prefill", "decode")}
        rss_start = server_rss(cluster)
        before = {name: gauges(url, COUNTERS) for name, url in urls.items()}
        carried: dict[str, dict[str, float]] = {name: {} for name in urls}
        done = threading.Event()
        injector = threading.Thread(target=inject_faults, daemon=True, args=(
            cluster, faults, args.requests, tally, events, carried, problems, done))
        injector.start()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            futures = [pool.submit(run_conversation, cluster, args.seed, index, turns, tally)
                       for index, turns in enumerate(conversations)]
            for future in futures:
                future.result()
        done.set()
        injector.join()
        leaks = leaked_state(cluster, args.lease)
        rss_end = server_rss(cluster)
        after = {name: {metric: value + carried[name].get(metric, 0.0)
                        for metric, value in gauges(url, COUNTERS).items()}
                 for name, url in urls.items()}
    finally:
        cluster.stop()
    delta = {f"{name} {metric}": after[name][metric] - before[name][metric]
             for name in urls for metric in before[name]}
    return report(tally, leaks, rss_start, rss_end, delta, events,
                  time.monotonic() - began, problems)


def soak_deployment(faults: list[str], store: bool = False) -> Deployment:
    """1P1D over NIXL; with the Mooncake store on both roles when asked for or when its
    master is one of the faults (prefill gives it a segment, decode only uses it)."""
    if store or "mooncake-restart" in faults:
        return mooncake_pd()
    return Deployment(pd=True)


def report(tally: Tally, leaks: dict[str, float], rss_start: dict[str, int],
           rss_end: dict[str, int], delta: dict[str, float], events: list[str],
           seconds: float, problems: list[str] | tuple[str, ...] = ()) -> int:
    """Print the table; 0 only with nothing wrong, nothing leaked, enough completed and
    no fault that went wrong (`problems`: what a fault's own checks found)."""
    enough = tally.equal * 2 >= tally.not_aborted
    rows = [
        ("requests sent", tally.sent),
        ("completed, equal to colocated", tally.equal),
        ("failed with a clear error", tally.failed_clearly),
        ("aborted by the client", tally.aborted),
        ("group requests (n > 1) sent", tally.groups),
        ("groups completed, every choice equal", tally.groups_equal),
        ("mismatches (must be 0)", len(tally.mismatches)),
        ("unclear failures (must be 0)", len(tally.unclear)),
        *((f"{name} memory start / end (MiB)",
           f"{rss_start[name] >> 20} / {rss_end[name] >> 20}") for name in rss_start),
        *((f"{name} +", f"{value:g}") for name, value in delta.items()),
        ("leaked per-request state (must be 0)", int(sum(1 for v in leaks.values() if v))),
        ("faults that went wrong (must be 0)", len(problems)),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"\n{'what':{width}}  value")
    print("-" * (width + 12))
    for name, value in rows:
        print(f"{name:{width}}  {value}")
    for event in events:
        print(f"  fault: {event}")
    for problem in problems:
        print(f"  fault went wrong: {problem}")
    for kind, count in tally.failure_kinds.most_common(5):
        print(f"  failed {count}x: {kind}")
    for line in (*tally.mismatches, *tally.unclear)[:20]:
        print(f"  {line}")
    for name, value in leaks.items():
        print(f"  leaked: {name} = {value:g}")
    if not enough:
        print(f"  only {tally.equal} of {tally.not_aborted} requests that were not aborted "
              "completed: the run proves too little")
    ok = (not tally.mismatches and not tally.unclear and not leaks and enough
          and not problems)
    print(f"soak: {tally.sent} requests, {tally.equal} equal, {len(tally.mismatches)} "
          f"mismatches, {len(leaks)} leaks ({seconds:.0f} s): {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def fault_list(value: str) -> str:
    unknown = [f for f in value.split(",") if f and f not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)} "
            "(comma-separated), or '' for none")
    return value


def group_size(value: str) -> int:
    number = int(value)
    if number == 1 or number < 0:
        raise argparse.ArgumentTypeError(
            f"must be 0 (no groups) or at least 2 (a group of n completions), got {number}")
    return number


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=positive_int, default=500,
                        help="requests to send, all turns counted (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--concurrency", type=positive_int, default=8,
                        help="clients at once (default: %(default)s)")
    parser.add_argument("--group-size", type=group_size, default=DEFAULT_GROUP_SIZE,
                        metavar="N",
                        help=f"n of the RL group requests mixed in (about "
                        f"{GROUP_SHARE * 100:.0f}%% of the conversations become one "
                        "seeded, sampled request with this n, each choice compared with "
                        "the reference's choice of the same index); 0 for single requests "
                        "only (default: %(default)s)")
    parser.add_argument("--faults", type=fault_list, default=DEFAULT_FAULTS,
                        help=f"comma-separated, from {', '.join(FAULTS)}; '' for none "
                        "(default: %(default)s)")
    parser.add_argument("--store", action="store_true",
                        help="deploy the Mooncake store (prefill gives it a segment, decode "
                        "uses it) without restarting its master; the mooncake-restart "
                        "fault implies it")
    parser.add_argument("--mode", choices=(ROWS_OVER_NIXL, PROXY_MERGE),
                        default=ROWS_OVER_NIXL,
                        help=f"{ROWS_OVER_NIXL}: rows travel with the KV; {PROXY_MERGE}: "
                        "the proxy merges the halves (default: %(default)s)")
    deprecated_values(parser, "--mode", {"rows-transfer": ROWS_OVER_NIXL,
                                         "merge": PROXY_MERGE})
    parser.add_argument("--lease", type=positive_int, default=LEASE_SECONDS,
                        help="NIXL kv_lease_duration in seconds (default: %(default)s)")
    parser.add_argument("--fault",
                        choices=fault_registry.choices(fault_registry.SOAK),
                        help="negative control: plant this fault on decode; the run must "
                        "exit 1")
    parser.add_argument("--workdir", type=Path, help="model and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    if args.fault == "leak-floors" and args.mode == ROWS_OVER_NIXL:
        parser.error("--fault leak-floors plants a leak of decode emit floors, which only "
                     f"exist without rows transfer: add --mode {PROXY_MERGE}")
    return soak(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
