"""Whether a just-started deployment is up, and what to keep when it is not: the
timeouts `Cluster.start` (tools/e2e/cluster.py) waits with, the warm-up of a TP > 1
server's first compile, the first P/D requests that do decode's NIXL handshakes,
the quieting of threads that spin while it idles, and the record of a start that
stalled (stalls.log, each attempt's logs kept aside).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
from collections.abc import Mapping
from pathlib import Path

from tools.testbed.cpu_server import VllmServer, cpu_env, post_json
from tools.testbed.spinners import deprioritise, process_tree, spinning_threads
from tools.testbed.stalls import stall_report
from tools.testbed.warm_tp_compile import WORKER_INDUCTOR_ENV
from tools.e2e.scenarios import BLOCK_SIZE, prompt_ids

REPO_ROOT = Path(__file__).resolve().parents[2]

# A server of TP > 1 compiles upstream's VocabParallelEmbedding input mask with
# torch.compile (Inductor) on its first forward. Cold (a fresh machine, a new dtype)
# on a loaded 2-core host that took longer than vLLM's 300 s for one execute_model,
# and the engine died with "RPC call to execute_model timed out"
# (docs/deployment-shapes.md). The harness gives the first forward room instead.
TP_EXECUTE_MODEL_TIMEOUT_S = 1800
# The first P/D request waits for that first forward: post_json's default otherwise.
FIRST_REQUEST_TIMEOUT_S = 300.0
# How long a server may take to answer /health, and how often a deployment is started
# before its start fails (Cluster.start; docs/testing.md says why it is retried).
SERVER_READY_TIMEOUT_S = 600.0
START_ATTEMPTS = 2
# What the host's threads did while a start or a request waited long, beside the
# servers' logs (tools/testbed/stalls.py).
STALLS_LOG = "stalls.log"
# Each deployment's requests, sent and answered (the harness writes it).
REQUESTS_LOG = "requests.log"
# The name process_owners gives the front's processes (the router or proxy).
FRONT = "front"


def first_request_timeout(prefill_tp: int, decode_tp: int) -> float:
    """How long the first P/D request may take: a TP > 1 role's first forward gets
    the room its execute_model timeout gives it."""
    if max(prefill_tp, decode_tp) > 1:
        return float(TP_EXECUTE_MODEL_TIMEOUT_S)
    return FIRST_REQUEST_TIMEOUT_S


# Models whose TP embedding mask this process has compiled (warm_tp_compile).
_WARMED: set[tuple[str, int]] = set()


def warm_tp_compile(model: Path, tp: int) -> None:
    """Compile upstream's TP embedding mask into Inductor's cache before a server of
    `tp` ranks starts (tools/testbed/warm_tp_compile.py), once per model and TP in
    this process: the servers' first forward then finds the C++ compiled (11 s cold,
    3.5 s warmed for a TP = 2 server's first request on an idle 2-core VM), and the
    first P/D request waits that much less. Best effort: a failure is printed and the
    servers compile it themselves, within TP_EXECUTE_MODEL_TIMEOUT_S."""
    key = (str(model), tp)
    if tp < 2 or key in _WARMED:
        return
    config = json.loads((model / "config.json").read_text())
    vocab_size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if vocab_size is None:
        print(f"e2e:   {model}/config.json has no vocab_size; the TP {tp} servers "
              "compile their embedding mask on their first forward", flush=True)
        return
    env = cpu_env()
    env.update(WORKER_INDUCTOR_ENV)
    command = [sys.executable, "-m", "tools.testbed.warm_tp_compile",
               "--vocab-size", str(vocab_size), "--tp", str(tp)]
    start = time.monotonic()
    result = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        print(f"e2e:   warming the TP {tp} embedding-mask compile failed (exit "
              f"{result.returncode}); the servers compile it on their first forward:\n"
              f"{(result.stdout + result.stderr)[-2000:]}", flush=True)
        return
    _WARMED.add(key)
    print(f"e2e:   TP {tp} embedding-mask compile warmed in "
          f"{time.monotonic() - start:.0f} s", flush=True)


def first_handshakes(front_url: str, num_prefill: int, prefill_tp: int,
                     decode_tp: int) -> None:
    """One one-block P/D request per prefill instance through the front end at
    `front_url`, before any scenario, so that decode's first NIXL handshake with a
    prefill is not part of a checked request. vLLM waits 5 s for the handshake's
    answer (nixl/base_worker.py, RCVTIMEO 5000, not configurable); on this 2-core VM
    that expired on 2 of 7 deployments' first P/D request (2026-12-03), and the next
    handshake succeeded a second later. Best effort: an outcome other than 200 is
    printed and the scenarios handshake again; a request that gets no answer at all
    is a deployment that did not come up (TimeoutError). The caller leaves out
    deployments with offload (a warm-up block would change what their small KV caches
    evict) and runs with a planted fault (whose counts it would add to)."""
    for index in range(num_prefill):
        body = {"model": "tiny", "prompt": prompt_ids(997, index, BLOCK_SIZE + 1),
                "max_tokens": 1, "temperature": 0}
        start = time.monotonic()
        timeout = first_request_timeout(prefill_tp, decode_tp)
        try:
            code, answer = post_json(front_url, "/v1/completions", body, timeout=timeout)
        except (TimeoutError, urllib.error.URLError) as exc:
            raise TimeoutError(
                f"first P/D request {index + 1} (NIXL handshake) got no answer in "
                f"{timeout:.0f} s: {exc}") from exc
        outcome = "ok" if code == 200 else f"HTTP {code}: {str(answer)[:200]}"
        print(f"e2e:   first P/D request (NIXL handshake) {index + 1}: {outcome} "
              f"in {time.monotonic() - start:.0f} s", flush=True)


def process_owners(servers: Mapping[str, VllmServer],
                   front: subprocess.Popen[bytes] | None) -> dict[int, str]:
    """Every live process of a deployment: pid -> server name (FRONT for the router
    or proxy)."""
    owner = {pid: name for name, server in servers.items()
             if server.process is not None
             for pid in process_tree(server.process.pid)}
    if front is not None:
        owner.update({pid: FRONT for pid in process_tree(front.pid)})
    return owner


def deprioritise_spinners(owners: Mapping[int, str], nice: int) -> None:
    """Nice `nice` for every thread of the servers in `owners` busy while the
    just-started deployment serves nothing (NIXL's progress threads):
    tools/testbed/spinners.py says why. The front's threads are left alone."""
    owner = {pid: name for pid, name in owners.items() if name != FRONT}
    threads = spinning_threads(owner)
    deprioritise(threads, nice)
    found = ", ".join(f"{owner[t.pid]} {t.tid} ({t.busy:.2f} CPU s/s)" for t in threads)
    print(f"e2e:   nice {nice} for {len(threads)} thread(s) busy while the "
          f"deployment is idle{': ' + found if found else ''}", flush=True)


def record_start_stall(logs: Path, attempt: int, exc: TimeoutError,
                       owners: Mapping[int, str],
                       servers: Mapping[str, VllmServer]) -> None:
    """While the servers still run: what every thread on the host does
    (tools/testbed/stalls.py) and each server's last log lines, into stalls.log."""
    report = stall_report(dict(owners))
    tails = "\n".join(f"--- {name}.log (last lines)\n{server.log_tail(12)}"
                      for name, server in servers.items())
    entry = (f"{time.strftime('%H:%M:%S')} start attempt {attempt} timed out: "
             f"{str(exc).splitlines()[0]}\n{report}\n{tails}\n")
    with (logs / STALLS_LOG).open("a") as log:
        log.write(entry)
    # Printed too: a CI run shows a failed test's output, not its files.
    print(f"e2e:   {entry}e2e:   (kept in {logs / STALLS_LOG})", flush=True)


def keep_attempt_logs(logs: Path, attempt: int) -> Path:
    """Move the servers', the front's and the master's logs aside before the next
    attempt reuses their names (stalls.log and the harness's requests.log stay: they
    are appended to); return where they went."""
    kept = logs / f"attempt-{attempt}"
    kept.mkdir(exist_ok=True)
    for path in logs.glob("*.log"):
        if path.name not in (STALLS_LOG, REQUESTS_LOG):
            path.rename(kept / path.name)
    return kept
