#!/usr/bin/env python3
"""What routed experts cost a deployment: CPU time per request and per returned row,
routed experts on vs off, colocated and P/D, side by side in one run, on GPUs or on CPU.

On a GPU host (what users run; builds and installs the CUDA fork wheel first):

    python -m benchmarks.gpu.r3_cost --device cuda --model Qwen/Qwen3-30B-A3B --tp 4 \\
        --build-wheel --prompt-tokens 1024 8192 --completion-tokens 64

On CPU, a tiny MoE with a real model's routing shape (tools/testbed/tiny_moe.py);
`make test` runs this at the smallest preset so that the procedure cannot rot:

    python -m benchmarks.gpu.r3_cost --device cpu --preset qwen3-30b-a3b

Variants (`--deployments` picks the families; each needs its own off baseline):

- colocated: one `vllm serve` without routed experts (off), one with
  `--enable-return-routed-experts` (on), and the on server asked for no rows
  (`return_routed_experts: false`, should cost what off costs);
- rows-over-nixl: prefill + decode over NIXL behind the real `vllm-router`, the rows
  travelling with the KV (`enable_routed_experts_transfer`), divided by the same pair
  and router with routed experts off (pd off);
- proxy-merge: the prefill instance returns its rows and `vllm-r3-pdproxy` merges them
  with decode's, divided by pd off, and rows over NIXL divided by the proxy merge
  (`pd-transfer` and `pd-splice`, the families' old names, still work and warn);
- offload-native, offload-mooncake: one colocated `vllm serve` with a KV offload
  connector (vLLM's OffloadingConnector with its CPU tier; the Mooncake store and a
  `mooncake_master` this script starts), routed experts off, and on with the rows
  stored with the offloaded chunks (`enable_routed_experts_transfer`), asked for rows
  from 0 and from P (the prompt's end: no prompt rows, so none loaded). Every request
  is sent twice: once to compute and store its chunks, then, after the GPU prefix
  cache is dropped (`/reset_prefix_cache`, a development endpoint, not measured),
  once to load them. `offload-mooncake` needs the Mooncake store installed.

Every deployment is started alone, one after the other (two NIXL pairs on one small
host hung their first handshake), gets one warm-up request per prompt length, then
`--rounds` rounds of the same fixed request set (`--requests` prompts of each length,
each round's prompts led by a number no other round of the run used, so nothing
hits a prefix cache or a shorter prompt's blocks), `--concurrency` at a
time. `--cycles K` runs that sequence K times, reversed in every other cycle (A B,
B A, ...): this host's speed drifts by a few percent over a run, and in a fixed order
the drift falls on the deployments unevenly; ratios are then printed per cycle too.
Requests ask for rows from position 0 (from P where the variant says so), and every
response is checked: C tokens; where rows are asked for, one row per position
from 0 (P) to P + C - 2 of the model's routing shape (layers x top-k, from its
config.json), none elsewhere. With offload, the first send of a request must hit
nothing and the second must load a prefix (`usage.prompt_tokens_details`), whose rows
must equal the first send's. A wrong answer stops the run: a fast wrong answer is
not a measurement.

Measured per round (benchmarks/cpu_meter.py): CPU seconds (user + system, /proc) of
every process of the deployment (API servers, engine cores, workers, the router or
proxy) and of this client (HTTP, JSON, the fork's row decoder), without the threads
that poll while the deployment is idle (NIXL's progress threads: their CPU follows the
wall clock, and is printed apart; the harness sets them to nice 19, `--spinner-nice`
to another value); wall clock and tokens/s as secondary columns;
response bytes. Printed: the median over the rounds and its spread, the ratios above,
and the CPU per returned row (on - off over all processes, in µs), broken down by
process. `--tally` also times the functions of the rows path inside the servers
(benchmarks/rows_tally.py: thread CPU per function, rows on - off, per returned row),
which resolves costs that whole requests cannot. `--json FILE` writes every printed
figure. docs/performance.md says how to read them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cpu_meter import CpuMeter, CpuUse
# The fixed request set (token ids 4..511: words of the tiny model's vocabulary,
# ordinary tokens of a real one), as cpu_per_request's; the rounds' order, spread and
# record are the measuring core's.
from benchmarks.measure import Result, add_json_option, order, spend, spread
from benchmarks.request_set import prompts
from benchmarks.rows_tally import COMPONENTS, FLUSH_S, Tally, read_tally, tally_env
from tools.testbed.aliases import PROXY_MERGE, ROWS_OVER_NIXL, deprecated_values
from tools.testbed.spinners import (
    SPINNER_NICE,
    SpinningThread,
    process_tree,
    spinning_threads,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT_FAMILIES = ("colocated", ROWS_OVER_NIXL, PROXY_MERGE, "offload-native",
                       "offload-mooncake")
# The P/D families' old names (docs/glossary.md), still taken by --deployments.
OLD_FAMILIES = {"pd-transfer": ROWS_OVER_NIXL, "pd-splice": PROXY_MERGE}
SERVED_NAME = "tiny"  # the harness's servers answer to this name, whatever the model
# How configs name the routed-expert count: Qwen3-MoE, DeepSeek / GLM, Mixtral.
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@dataclass(frozen=True)
class Routing:
    """The rows a model returns per token: one row of `top_k` expert ids per decoder
    layer, ids below `num_experts`."""

    num_layers: int
    top_k: int
    num_experts: int


@dataclass(frozen=True)
class Variant:
    name: str
    served_by: str  # the deployment: colocated-off/-on, pd-off, rows-over-nixl, proxy-merge
    rows: bool  # its responses carry rows
    opt_out: bool = False  # its requests set return_routed_experts: false
    front: str | None = None  # P/D: what sits in front, "vllm-router" or "pdproxy"
    rows_from_prompt_end: bool = False  # rows from P, not from 0
    # Offload: each request sent twice, to store its chunks and then to load them.
    loads: bool = False


VARIANTS: dict[str, tuple[Variant, ...]] = {
    "colocated": (Variant("colocated off", "colocated-off", rows=False),
                  Variant("colocated on", "colocated-on", rows=True),
                  Variant("colocated on, opted out", "colocated-on", rows=False,
                          opt_out=True)),
    # Each P/D mode against the same pair with routed experts off behind the same front.
    ROWS_OVER_NIXL: (Variant("pd off (vllm-router)", "pd-off", rows=False,
                             front="vllm-router"),
                     Variant("rows over NIXL (vllm-router)", ROWS_OVER_NIXL, rows=True,
                             front="vllm-router")),
    PROXY_MERGE: (Variant("pd off (pdproxy)", "pd-off", rows=False, front="pdproxy"),
                  Variant("proxy merge (pdproxy)", PROXY_MERGE, rows=True, front="pdproxy")),
    **{f"offload-{kind}": (
        Variant(f"{kind} off", f"{kind}-off", rows=False, loads=True),
        Variant(f"{kind} on, rows from 0", f"{kind}-on", rows=True, loads=True),
        Variant(f"{kind} on, rows from P", f"{kind}-on", rows=True, loads=True,
                rows_from_prompt_end=True)) for kind in ("native", "mooncake")},
}
# (on, off): CPU per request, all processes, and the per-row difference. RATIOS adds
# two quotients that are no on - off pair.
ON_OFF_PAIRS = (("colocated on", "colocated off"),
                ("rows over NIXL (vllm-router)", "pd off (vllm-router)"),
                ("proxy merge (pdproxy)", "pd off (pdproxy)"),
                ("native on, rows from 0", "native off"),
                ("native on, rows from P", "native off"),
                ("mooncake on, rows from 0", "mooncake off"),
                ("mooncake on, rows from P", "mooncake off"))
RATIOS = (*ON_OFF_PAIRS, ("colocated on, opted out", "colocated off"),
          ("rows over NIXL (vllm-router)", "proxy merge (pdproxy)"))


class ResponseError(RuntimeError):
    """A response that is not the answer asked for."""


def check_response(response: dict[str, Any], prompt: list[int], completion: int,
                   routing: Routing | None, start: int = 0) -> np.ndarray | None:
    """The rows of a completion response, after checking it: `completion` tokens;
    with `routing`, one row per position from `start` to P + C - 2 of that shape
    (decoded by the fork's client decoder); without, no rows at all (None)."""
    if "error" in response:
        raise ResponseError(f"the request failed: {str(response['error'])[:400]}")
    choice = response["choices"][0]
    tokens = choice.get("token_ids") or []
    if len(tokens) != completion:
        raise ResponseError(f"{len(tokens)} tokens returned, {completion} asked for")
    if routing is None:
        if choice.get("routed_experts") is not None:
            raise ResponseError("rows returned where none were asked for")
        return None
    from vllm.entrypoints.routed_experts import RoutedExpertsError, decode_routed_experts

    try:
        decoded = decode_routed_experts(choice, prompt_token_ids=prompt)
    except RoutedExpertsError as exc:
        raise ResponseError(f"rows that do not decode: {exc}") from None
    rows = decoded.rows
    shape = (len(prompt) + completion - 1 - start, routing.num_layers, routing.top_k)
    if choice.get("routed_experts_start") != start or tuple(rows.shape) != shape:
        raise ResponseError(
            f"rows from {choice.get('routed_experts_start')} of shape {tuple(rows.shape)}; "
            f"expected from {start}, shape {shape} (P + C - 1 - {start} positions x "
            "layers x top-k)")
    if rows.size and int(rows.max()) >= routing.num_experts:
        raise ResponseError(f"expert id {int(rows.max())} in the rows; the model has "
                            f"{routing.num_experts} experts")
    return rows


def cached_tokens(response: dict[str, Any]) -> int:
    """The prompt tokens the server did not compute (prefix cache and KV connector
    hits), from `usage.prompt_tokens_details` (`--enable-prompt-tokens-details`)."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" not in details:
        raise ResponseError("the response has no usage.prompt_tokens_details."
                            "cached_tokens: serve with --enable-prompt-tokens-details")
    return int(details["cached_tokens"] or 0)


@dataclass
class Answer:
    """One checked response."""

    size: int  # bytes
    rows: np.ndarray | None
    cached: int  # prompt tokens not computed; 0 where not read


def check_loads(first: Answer, second: Answer, prompt_tokens: int,
                rows_start: int = 0) -> None:
    """An offload variant's two sends of one request: the first computes everything
    (and stores its chunks), the second loads a prefix of them, and the rows of that
    prefix from `rows_start` on are the first send's rows (they were stored with the
    chunks). The positions past it are computed again and not compared (a forward
    over a loaded prefix need not round like the whole prompt's)."""
    if first.cached:
        raise ResponseError(f"the first send found {first.cached} of {prompt_tokens} "
                            "prompt tokens cached: its round's prompts are not new")
    if not second.cached:
        raise ResponseError(
            f"the second send loaded none of its {prompt_tokens} prompt tokens from the "
            "offload tier (stored nothing, or evicted it: raise --offload-gib)")
    if first.rows is None or second.rows is None:
        return
    loaded = max(0, min(second.cached - rows_start, len(first.rows)))
    diff = np.flatnonzero((first.rows[:loaded] != second.rows[:loaded]).any(axis=(1, 2)))
    if diff.size:
        raise ResponseError(
            f"the rows loaded with the offloaded chunks differ from the computed ones at "
            f"{diff.size} of {loaded} positions, first {int(diff[0])}: "
            f"{second.rows[diff[0]].tolist()} != {first.rows[diff[0]].tolist()}")


def post_completion(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict]:
    """POST /v1/completions; the response's size in bytes and its JSON."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        return 0, {"error": f"HTTP {exc.code}: {exc.read().decode()[:600]}"}
    return len(raw), json.loads(raw)


SALT_BASE = 508  # token ids 4..511


def salted(prompt: list[int], batch: int) -> list[int]:
    """`prompt` led by `batch` in two tokens (base 508): the requests of one round
    share a batch number no other round of the run has, so their first block differs
    from every other round's (other variants, cells and lengths included: the prompts
    of one index share their leading tokens across lengths) and no prefix cache or
    offload tier serves them."""
    if not 0 <= batch < SALT_BASE**2:
        raise ValueError(f"batch {batch} does not fit two salt tokens")
    return [4 + batch // SALT_BASE, 4 + batch % SALT_BASE, *prompt[2:]]


@dataclass
class RoundResult:
    cpu: CpuUse  # the deployment's processes, polling threads excluded
    client_cpu: float  # this process: HTTP, JSON, row decoding
    wall: float
    requests: int
    tokens: int  # generated
    rows: int  # returned
    response_bytes: int
    cached: int = 0  # prompt tokens not computed (offload: loaded)
    cycle: int = 0  # which start of its deployment served it (`--cycles`)
    tally: Tally | None = None  # the rows path's functions (`--tally`)


@dataclass
class Running:
    """A started deployment: its servers' processes by role, its front ends (name ->
    URL and process; a colocated server is its own front, None), how to stop it."""

    roots: dict[str, int]
    fronts: dict[str | None, tuple[str, int | None]]
    stop: Callable[[], None]
    pollers: list[SpinningThread] = field(default_factory=list)
    tally_dir: Path | None = None  # where its processes write their rows tally
    # Drop the GPU prefix cache (offload servers: the tier keeps its chunks).
    reset_prefix_cache: Callable[[], None] | None = None

    def route(self, variant: Variant) -> tuple[str, dict[str, int]]:
        """Where `variant`'s requests go, and the processes its CPU is read from."""
        url, pid = self.fronts[variant.front]
        return url, {**self.roots, **({"front": pid} if pid is not None else {})}


@dataclass(frozen=True)
class Target:
    """Where the deployments run and what they serve."""

    device: str  # "cpu" or "cuda"
    model: str  # a path or a Hugging Face id
    routing: Routing
    serve_args: tuple[str, ...]  # besides routed experts and the KV connector
    tp: int
    workdir: Path
    offload_gib: float = 4.0  # each offload tier's size
    spinner_nice: int = SPINNER_NICE  # P/D: NIXL's progress threads' nice value

    def env(self, name: str) -> dict[str, str]:
        """A server's environment on a GPU host: the P/D decode instance takes the GPUs
        after prefill's; a colocated server, the first ones."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("VLLM_CPU_") and key != "VLLM_TARGET_DEVICE"}
        first = self.tp if name == "decode" else 0
        env.update({"CUDA_VISIBLE_DEVICES": ",".join(str(first + i) for i in range(self.tp)),
                    "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1"})
        return env


def start_colocated(target: Target, name: str, routed_experts: bool,
                    extra_args: tuple[str, ...] = (),
                    env_extra: dict[str, str] | None = None) -> Running:
    """One `vllm serve`, with routed experts or without; `name` names its log."""
    from tools.testbed.cpu_server import VllmServer, cpu_env

    env = cpu_env(opt_in=True) if target.device == "cpu" else target.env("colocated")
    server = VllmServer(
        model=Path(target.model),  # a Hugging Face id passes through as the same string
        log_path=target.workdir / f"{name}.log",
        extra_args=(*(("--enable-return-routed-experts",) if routed_experts else ()),
                    *target.serve_args, *extra_args),
        env={**env, **(env_extra or {})},
        enforce_eager=target.device == "cpu")
    server.start()
    try:
        server.wait_ready(timeout=1800)
    except BaseException:
        server.stop()
        raise
    assert server.process is not None
    return Running({"server": server.process.pid}, {None: (server.url, None)}, server.stop)


# An offload server's responses say how many prompt tokens it did not compute; its
# GPU prefix cache is dropped between a round's two sends (`/reset_prefix_cache`, a
# development endpoint), so that the second loads from the offload tier. (Routed
# experts need prefix caching on.)
OFFLOAD_SERVE_ARGS = ("--enable-prompt-tokens-details",)
OFFLOAD_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
RESET_TIMEOUT_S = 120.0


def reset_prefix_cache(url: str, timeout: float = RESET_TIMEOUT_S) -> None:
    """POST /reset_prefix_cache until it succeeds: it fails while blocks are held (an
    offload store still in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            if json.loads(resp.read()).get("success"):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/reset_prefix_cache did not succeed in {timeout:.0f} "
                               "s: blocks are still held (a stuck offload store?)")
        time.sleep(0.2)


def start_offload(target: Target, served_by: str) -> Running:
    """A colocated server with a KV offload connector ("native-on", "mooncake-off",
    ...), its chain from the same builder as `vllm kv-transfer-config`; with routed
    experts, the rows are stored with the chunks. The Mooncake store gets its own
    `mooncake_master` (TCP), stopped with the server."""
    from vllm.distributed.kv_transfer.role_chains import Deployment, build_role_config

    from tools.e2e.cluster_spec import mooncake, native
    from tools.e2e.mooncake_master import MooncakeMaster

    kind, state = served_by.split("-")
    routed_experts = state == "on"
    tier_bytes = int(target.offload_gib * (1 << 30))
    master = None
    if kind == "mooncake":
        master = MooncakeMaster(target.workdir / served_by)
        master.start()
    try:
        config = build_role_config(
            Deployment(pd=False, offload=native(tier_bytes) if kind == "native"
                       else mooncake(tier_bytes), routed_experts_transfer=routed_experts),
            "colocated", master.client() if master is not None else None)
        print(f"{served_by}: {config.summary}", flush=True)
        env = dict(OFFLOAD_SERVER_ENV)
        if config.mooncake_config is not None:
            path = target.workdir / f"mooncake-{served_by}.json"
            path.write_text(json.dumps(config.mooncake_config, indent=1))
            env["MOONCAKE_CONFIG_PATH"] = str(path)
        running = start_colocated(
            target, served_by, routed_experts,
            ("--kv-transfer-config", json.dumps(config.kv_transfer_config),
             *OFFLOAD_SERVE_ARGS), env)
    except BaseException:
        if master is not None:
            master.stop()
        raise
    url, _ = running.fronts[None]
    running.reset_prefix_cache = lambda: reset_prefix_cache(url)
    if master is None:
        return running
    stop_server = running.stop

    def stop() -> None:
        stop_server()
        master.stop()

    running.stop = stop
    return running


def start_pd(target: Target, served_by: str, fronts: list[str]) -> Running:
    """A P/D pair behind `fronts` (vllm-router, pdproxy), the first started by the
    harness's cluster, the others beside it."""
    from tools.e2e.cluster import Cluster
    from tools.e2e.cluster_spec import ClusterSpec
    from tools.testbed.cpu_server import free_port, stop_process_group

    spec = ClusterSpec(
        Path(target.model), serve_args=target.serve_args, reference=False,
        routed_experts=served_by != "pd-off",
        routed_experts_transfer=served_by == ROWS_OVER_NIXL,
        router=fronts[0],
        kv_buffer_device="cpu" if target.device == "cpu" else "cuda",
        enforce_eager=target.device == "cpu", spinner_nice=target.spinner_nice,
        server_env=None if target.device == "cpu" else target.env)
    cluster = Cluster(spec, target.workdir / served_by)
    cluster.start()
    assert cluster.proxy_process is not None
    started: dict[str | None, tuple[str, int | None]] = {
        fronts[0]: (cluster.proxy_url, cluster.proxy_process.pid)}
    others: list[subprocess.Popen[bytes]] = []

    def stop() -> None:
        for process in others:
            stop_process_group(process)
        cluster.stop()

    try:
        for front in fronts[1:]:
            port = free_port()
            others.append(cluster.start_front_end(front, port, front))
            started[front] = (f"http://127.0.0.1:{port}", others[-1].pid)
    except BaseException:
        stop()
        raise
    roots = {name: server.process.pid for name, server in cluster.servers.items()
             if server.process is not None}
    return Running(roots, started, stop)


def start(target: Target, served_by: str, variants: list[Variant],
          tally_dir: Path | None = None) -> Running:
    """Start `served_by`; with `tally_dir`, its processes tally the rows path there."""
    saved = dict(os.environ)
    if tally_dir is not None:  # the servers' environments are copied from this one
        os.environ.update(tally_env(tally_dir))
    try:
        if served_by.startswith("colocated"):
            running = start_colocated(target, served_by, served_by == "colocated-on")
        elif served_by.startswith(("native-", "mooncake-")):
            running = start_offload(target, served_by)
        else:
            fronts = list(dict.fromkeys(v.front for v in variants
                                        if v.served_by == served_by and v.front))
            running = start_pd(target, served_by, fronts)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    running.tally_dir = tally_dir
    # Threads busy while the deployment serves nothing poll (NIXL's progress threads).
    pids = [pid for root in running.roots.values() for pid in process_tree(root)]
    running.pollers = spinning_threads(pids)
    print(f"{served_by}: ready; {len(running.pollers)} polling "
          "thread(s) excluded from the CPU figures", flush=True)
    return running


def run_round(running: Running, variant: Variant, batch: int,
              requests: list[list[int]], completion: int, concurrency: int,
              routing: Routing, timeout: float) -> RoundResult:
    """Send `requests` (salted with `batch`, unique to this round) to `variant`; an
    offload variant sends them all twice (store, then load)."""
    bodies = []
    for prompt in requests:
        prompt = salted(prompt, batch)
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": completion,
                "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        if variant.opt_out:
            body["return_routed_experts"] = False
        elif variant.rows:
            body["routed_experts_prompt_start"] = rows_start(variant, prompt)
        bodies.append(body)

    url, roots = running.route(variant)

    def one(body: dict[str, Any]) -> Answer:
        size, response = post_completion(url, body, timeout)
        start = body.get("routed_experts_prompt_start", 0)
        rows = check_response(response, body["prompt"], completion,
                              routing if variant.rows else None, start)
        return Answer(size, rows, cached_tokens(response) if variant.loads else 0)

    meter = CpuMeter(roots, running.pollers)
    tally_before = settled_tally(running.tally_dir)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        spent, answers = spend(lambda: list(pool.map(one, bodies)), meter)
        if variant.loads:
            assert running.reset_prefix_cache is not None, variant.served_by
            running.reset_prefix_cache()  # not measured: no GPU hit for the second send
            second_spent, second = spend(lambda: list(pool.map(one, bodies)), meter)
            for body, first_answer, second_answer in zip(bodies, answers, second):
                check_loads(first_answer, second_answer, len(body["prompt"]),
                            body.get("routed_experts_prompt_start", 0))
            spent, answers = spent + second_spent, answers + second
    tally_after = settled_tally(running.tally_dir)
    assert spent.cpu is not None  # spent with the meter
    return RoundResult(spent.cpu, spent.own_cpu, spent.wall, len(answers),
                       completion * len(answers),
                       sum(len(a.rows) for a in answers if a.rows is not None),
                       sum(a.size for a in answers), sum(a.cached for a in answers),
                       tally=(tally_after - tally_before
                              if tally_after is not None and tally_before is not None
                              else None))


def settled_tally(directory: Path | None) -> Tally | None:
    """The deployment's rows tally once every process has written its last calls."""
    if directory is None:
        return None
    time.sleep(2 * FLUSH_S)
    return read_tally(directory)


def rows_start(variant: Variant, prompt: list[int]) -> int:
    """Where `variant`'s requests ask their rows to start: 0, or the prompt's end."""
    return len(prompt) if variant.rows_from_prompt_end else 0


def all_cpu(result: RoundResult) -> float:
    """CPU seconds of the whole deployment and the client."""
    return result.cpu.total + result.client_cpu


def per_request(results: list[RoundResult], value: Callable[[RoundResult], float]
                ) -> list[float]:
    return [value(r) / r.requests for r in results]


@dataclass(frozen=True)
class Cell:
    prompt_tokens: int
    concurrency: int


def summarise(cell: Cell, completion: int, results: dict[str, list[RoundResult]]
              ) -> dict[str, Any]:
    """Print one (prompt length, concurrency) cell's table; return its figures."""
    print(f"\nprompt {cell.prompt_tokens} + completion {completion} tokens, concurrency "
          f"{cell.concurrency}: median over rounds (spread)")
    print(f"{'variant':28} {'CPU s/req':>17} {'deployment':>10} {'client':>8} "
          f"{'polling':>8} {'wall s/req':>17} {'tok/s':>8} {'rows/req':>8} {'B/req':>11} "
          f"{'cached/req':>10}")
    figures: dict[str, Any] = {"prompt_tokens": cell.prompt_tokens,
                               "concurrency": cell.concurrency, "variants": {}}
    for name, rounds in results.items():
        cpu = per_request(rounds, all_cpu)
        wall = per_request(rounds, lambda r: r.wall)
        med = statistics.median
        row = {"cpu_s_per_request": med(cpu), "cpu_spread": spread(cpu).relative,
               "deployment_cpu": med(per_request(rounds, lambda r: r.cpu.total)),
               "client_cpu": med(per_request(rounds, lambda r: r.client_cpu)),
               "polling_cpu": med(per_request(rounds, lambda r: r.cpu.excluded)),
               "wall_s_per_request": med(wall), "wall_spread": spread(wall).relative,
               "tokens_per_s": med([r.tokens / r.wall for r in rounds]),
               "rows_per_request": med(per_request(rounds, lambda r: r.rows)),
               "bytes_per_request": med(per_request(rounds, lambda r: r.response_bytes)),
               "cached_per_request": med(per_request(rounds, lambda r: r.cached))}
        figures["variants"][name] = row
        print(f"{name:28} {row['cpu_s_per_request']:9.4f} ({row['cpu_spread']:5.1%}) "
              f"{row['deployment_cpu']:10.4f} {row['client_cpu']:8.4f} "
              f"{row['polling_cpu']:8.3f} {row['wall_s_per_request']:9.3f} "
              f"({row['wall_spread']:5.1%}) {row['tokens_per_s']:8.1f} "
              f"{row['rows_per_request']:8.0f} {row['bytes_per_request']:11,.0f} "
              f"{row['cached_per_request']:10.0f}")
    figures["ratios"] = {}
    for numerator, denominator in RATIOS:
        if numerator in results and denominator in results:
            ratio = (figures["variants"][numerator]["cpu_s_per_request"]
                     / figures["variants"][denominator]["cpu_s_per_request"])
            figures["ratios"][f"{numerator} / {denominator}"] = ratio
            by_cycle = cycle_ratios(results[numerator], results[denominator])
            figures.setdefault("ratios_by_cycle", {})[
                f"{numerator} / {denominator}"] = by_cycle
            cycles = (f" (by cycle: {', '.join(f'{r:.4f}' for r in by_cycle)})"
                      if len(by_cycle) > 1 else "")
            print(f"CPU per request, {numerator} / {denominator}: {ratio:.4f}{cycles}")
    figures["per_row"] = {}
    for numerator, denominator in ON_OFF_PAIRS:
        if numerator in results and denominator in results:
            figures["per_row"][numerator] = per_row_cost(numerator, results[numerator],
                                                         results[denominator])
            tally = per_row_tally(results[numerator], results[denominator])
            if tally:
                figures.setdefault("tally", {})[numerator] = tally
                print_tally(numerator, tally)
    return figures


def per_row_tally(on: list[RoundResult], off: list[RoundResult]) -> dict[str, Any]:
    """Each tallied function's thread CPU, on - off, in µs per returned row (medians
    over the rounds), with its calls per request; {} without a tally or rows."""
    if any(r.tally is None for r in on + off):
        return {}
    rows = statistics.median(r.rows / r.requests for r in on)
    if not rows:
        return {}
    functions = sorted({f for r in on + off for f in r.tally.seconds})  # type: ignore[union-attr]

    def median_per_request(results: list[RoundResult], function: str, kind: str) -> float:
        return statistics.median(getattr(r.tally, kind).get(function, 0) / r.requests
                                 for r in results)

    return {"functions": {function: {
        "component": COMPONENTS.get(function, "?"),
        "us_per_row": (median_per_request(on, function, "seconds")
                       - median_per_request(off, function, "seconds")) / rows * 1e6,
        "calls_per_request": median_per_request(on, function, "calls"),
    } for function in functions}, "missing": sorted(
        {m for r in on + off for m in r.tally.missing})}  # type: ignore[union-attr]


def print_tally(name: str, tally: dict[str, Any]) -> None:
    print(f"  {name}, rows path by function (thread CPU µs per returned row, on - off; "
          "calls per request with rows):")
    for function, figures in tally["functions"].items():
        print(f"    {figures['component']:38} {function.split(':')[-1]:45} "
              f"{figures['us_per_row']:9.3f} {figures['calls_per_request']:9.1f}")
    if tally["missing"]:
        print(f"    not in this vLLM (not timed): {', '.join(tally['missing'])}")


def cycle_ratios(numerator: list[RoundResult], denominator: list[RoundResult]
                 ) -> list[float]:
    """The CPU-per-request ratio within each cycle (the medians of the rounds each
    variant had in that cycle), in cycle order; cycles one side lacks are left out."""
    def medians(results: list[RoundResult]) -> dict[int, float]:
        cycles = sorted({r.cycle for r in results})
        return {c: statistics.median(per_request([r for r in results if r.cycle == c],
                                                 all_cpu)) for c in cycles}

    top, bottom = medians(numerator), medians(denominator)
    return [top[c] / bottom[c] for c in sorted(top) if c in bottom]


def deployment_order(served_by: list[str], cycles: int) -> list[tuple[int, str]]:
    """(cycle, deployment) in the order they are started: each cycle is a round of
    the measuring core (benchmarks/measure.py), the deployments in order in even
    cycles, reversed in odd ones (A B C, C B A, ...), so that a drift of the host's
    speed over the run weighs on every deployment alike."""
    return [(cycle, deployment) for cycle in range(cycles)
            for deployment in order(served_by, cycle)]


def per_row_cost(name: str, on: list[RoundResult], off: list[RoundResult]
                 ) -> dict[str, float]:
    """On - off per returned row, in µs: all CPU, by process (role/name) and the
    client, and the response bytes per row."""
    rows = statistics.median(r.rows / r.requests for r in on)
    if not rows:
        return {}

    def diff(value: Callable[[RoundResult], float]) -> float:
        return ((statistics.median(per_request(on, value))
                 - statistics.median(per_request(off, value))) / rows)

    cost = {"all_us": diff(all_cpu) * 1e6, "client_us": diff(lambda r: r.client_cpu) * 1e6,
            "bytes": diff(lambda r: r.response_bytes)}
    processes = {n for r in on + off for n in r.cpu.by_process}
    for process in sorted(processes):
        cost[f"{process}_us"] = diff(lambda r, n=process: r.cpu.by_process.get(n, 0.0)) * 1e6
    by_process = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in cost.items()
                           if k not in ("all_us", "bytes"))
    print(f"  {name}, per returned row, on - off: {cost['all_us']:.1f} µs CPU ({by_process}); "
          f"{cost['bytes']:.1f} response bytes")
    return cost


def routing_of(model: str) -> Routing:
    """The routing shape from the model's config.json (a local directory or a Hugging
    Face id): an independent source for the rows' shape."""
    path = Path(model) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).to_dict()
    config = config.get("text_config") or config  # a multimodal model's language model
    experts = next((config[key] for key in EXPERT_COUNT_KEYS if config.get(key)), None)
    if not experts or "num_experts_per_tok" not in config:
        raise SystemExit(f"{model}: its config.json names no routed experts (one of "
                         f"{', '.join(EXPERT_COUNT_KEYS)}, and num_experts_per_tok): "
                         "routed experts need a MoE model")
    return Routing(config["num_hidden_layers"], config["num_experts_per_tok"], experts)


def build_and_install_wheel() -> None:
    """`make wheel` (the CUDA fork wheel), then install it into this interpreter."""
    subprocess.run(["make", "wheel"], cwd=ROOT, check=True)
    wheels = sorted((ROOT / "dist").glob("vllm-*.whl"), key=lambda p: p.stat().st_mtime)
    subprocess.run([sys.executable, "-m", "pip", "install", "--force-reinstall",
                    "--no-deps", str(wheels[-1])], check=True)


def make_target(args: argparse.Namespace, workdir: Path) -> Target:
    max_len = max(args.prompt_tokens) + args.completion_tokens + 8
    sizes = ("--max-model-len", str(max_len), "--max-num-seqs", str(max(args.concurrency)),
             "--max-num-batched-tokens", str(max(max_len, 2048)))
    if args.device == "cpu":
        from tools.e2e.cluster_spec import CPU_SERVE_ARGS
        from tools.testbed.tiny_moe import build

        model = workdir / "model"
        build(model, num_experts=8, num_experts_per_tok=2, seed=0, preset=args.preset,
              max_model_len=max(max_len, 1024))
        return Target("cpu", str(model), routing_of(str(model)), (*CPU_SERVE_ARGS, *sizes),
                      1, workdir, args.offload_gib, args.spinner_nice)
    return Target("cuda", args.model, routing_of(args.model),
                  (*sizes, "--tensor-parallel-size", str(args.tp), *args.serve_arg),
                  args.tp, workdir, args.offload_gib, args.spinner_nice)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.r3_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--model", help="cuda: the model (a path or a Hugging Face id)")
    parser.add_argument("--preset", help="cpu: the tiny model's routing shape "
                        "(tools/testbed/tiny_moe.py PRESETS)", default="qwen3-30b-a3b")
    parser.add_argument("--tp", type=int, default=1,
                        help="cuda: tensor-parallel size of each instance (P/D: prefill "
                        "takes GPUs 0..tp-1, decode the next tp)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="cuda: one more `vllm serve` argument (repeat)")
    parser.add_argument("--build-wheel", action="store_true",
                        help="cuda: build the CUDA fork wheel (make wheel) and install it")
    parser.add_argument("--deployments", nargs="+", choices=DEPLOYMENT_FAMILIES,
                        default=[f for f in DEPLOYMENT_FAMILIES if f != "offload-mooncake"],
                        help="which families to run, each with its off baseline "
                        "(default: all but offload-mooncake, which needs the Mooncake "
                        "store: tools/setup-mooncake.sh)")
    deprecated_values(parser, "--deployments", OLD_FAMILIES)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024],
                        help="prompt lengths, one table each (default: 1024)")
    parser.add_argument("--completion-tokens", type=int, default=64,
                        help="tokens generated per request (default: 64)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="requests in flight at once, one table each (default: 1)")
    parser.add_argument("--offload-gib", type=float, default=4.0,
                        help="offload families: the CPU tier's size, or the memory the "
                        "server gives the Mooncake store; a round's requests must fit "
                        "(default: 4)")
    parser.add_argument("--requests", type=int, default=8, help="requests per round and cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tally", action="store_true",
                        help="time the functions of the rows path inside the servers "
                             "(benchmarks/rows_tally.py) and print them per returned row")
    parser.add_argument("--cycles", type=int, default=1,
                        help="start every deployment this many times, the order "
                             "reversed in each odd cycle (A B, B A, ...), with --rounds "
                             "rounds per start; ratios are printed per cycle too")
    parser.add_argument("--spinner-nice", type=int, default=SPINNER_NICE,
                        help="P/D: the nice value of the threads that poll while the "
                             "pair idles (NIXL's progress threads), 0-19; 0 leaves them "
                             f"as they start (default: {SPINNER_NICE}, for hosts with "
                             "fewer cores than busy threads: docs/performance.md)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    parser.add_argument("--workdir", type=Path, help="model and logs (default: a temp dir)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.model:
        parser.error("--device cuda needs --model (e.g. Qwen/Qwen3-30B-A3B)")
    if args.device == "cpu" and (args.model or args.build_wheel or args.serve_arg
                                 or args.tp != 1):
        parser.error("--model, --build-wheel, --serve-arg and --tp are for --device cuda; "
                     "on CPU the installed fork serves a tiny model with --preset's "
                     "routing shape, one instance per role")
    if args.device == "cpu":
        from tools.testbed.tiny_moe import PRESETS

        if args.preset not in PRESETS:
            parser.error(f"--preset {args.preset!r}: choose one of {', '.join(PRESETS)}")
    if "offload-mooncake" in args.deployments:
        try:
            import mooncake  # noqa: F401
        except ImportError:
            parser.error("--deployments offload-mooncake needs the Mooncake store in "
                         "this environment: run tools/setup-mooncake.sh")
    if args.cycles < 1:
        parser.error(f"--cycles must be at least 1, got {args.cycles}")
    if not 0 <= args.spinner_nice <= 19:
        parser.error(f"--spinner-nice must be 0-19 (0: as they start), got "
                     f"{args.spinner_nice}")
    if args.offload_gib <= 0:
        parser.error(f"--offload-gib must be positive, got {args.offload_gib}")
    if min(args.prompt_tokens) < 3 or args.completion_tokens < 1:
        parser.error("--prompt-tokens must be at least 3 and --completion-tokens at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.build_wheel:
        build_and_install_wheel()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="r3-cost-"))
    target = make_target(args, workdir)
    variants = {v.name: v for family in args.deployments for v in VARIANTS[family]}
    served_by = list(dict.fromkeys(v.served_by for v in variants.values()))
    print(f"{args.device}: {target.model}, routing {target.routing}; variants "
          f"{', '.join(variants)}; {args.requests} requests x {args.rounds} rounds per "
          f"cell; work dir {workdir}", flush=True)
    cells = [Cell(n, c) for n in args.prompt_tokens for c in args.concurrency]
    results: dict[Cell, dict[str, list[RoundResult]]] = {
        cell: {name: [] for name in variants} for cell in cells}
    batches = itertools.count()  # one salt per round of the whole run
    for cycle, deployment in deployment_order(served_by, args.cycles):
        if args.cycles > 1:
            print(f"cycle {cycle + 1} of {args.cycles}: {deployment}", flush=True)
        # Each start logs apart: a later cycle would overwrite an earlier one's logs.
        started = (replace(target, workdir=workdir / f"cycle-{cycle + 1}")
                   if args.cycles > 1 else target)
        started.workdir.mkdir(parents=True, exist_ok=True)
        tally_dir = started.workdir / "tally" / deployment if args.tally else None
        running = start(started, deployment, list(variants.values()), tally_dir)
        try:
            for cell in cells:
                requests = prompts(args.requests, cell.prompt_tokens)
                for variant in (v for v in variants.values() if v.served_by == deployment):
                    run_round(running, variant, next(batches), requests[:1],  # warm-up
                              args.completion_tokens, 1, target.routing, args.timeout)
                    results[cell][variant.name] += [
                        replace(run_round(running, variant, next(batches), requests,
                                          args.completion_tokens, cell.concurrency,
                                          target.routing, args.timeout), cycle=cycle)
                        for _ in range(args.rounds)]
        finally:
            running.stop()
    report = {"device": args.device, "model": target.model,
              "routing": asdict(target.routing), "preset": args.preset,
              "completion_tokens": args.completion_tokens, "requests": args.requests,
              "rounds": args.rounds, "cycles": args.cycles,
              "cells": [summarise(cell, args.completion_tokens, results[cell])
                        for cell in cells]}
    Result("benchmarks.gpu.r3_cost", vars(args), report,
           {f"{cell['prompt_tokens']} tokens, concurrency {cell['concurrency']}: {name}": value
            for cell in report["cells"] for name, value in cell["ratios"].items()}
           ).emit(args.json)
    return report


if __name__ == "__main__":
    main()
