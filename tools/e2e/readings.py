"""What a running harness deployment reports about itself, read from outside: its
servers' Prometheus series (counters, and the gauges that must read 0 once every
request has finished, else state leaked) and lines its servers logged.
`Cluster` (tools/e2e/cluster.py) reads through these; the harness and the soak check
the leak gauges.
"""

from __future__ import annotations

import urllib.error
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from tools.testbed.cpu_server import VllmServer
from tools.testbed.metrics import read_total

# The fork's per-request gauges (docs/metrics.md): 0 on a server whose requests have
# all finished; anything else is leaked state (the harness and the soak read them).
LEAK_GAUGES = ("vllm:routed_experts_tracked_requests", "vllm:routed_experts_emit_floors")
# vLLM's share of the KV cache in use: 0 on an idle server (cached blocks count as free).
KV_USAGE = "vllm:kv_cache_usage_perc"
# What a server under test logs for a pulled or offloaded block whose rows failed its
# check, for a KV load it recovered from by recomputing, and (prefill) for a lease
# that ran out before decode read the blocks.
ROWS_CHECK_FAILED = "failed their check"
RECOVERED_LOAD = "Recovered from KV load failure"
EXPIRED_LEASE = "Releasing expired KV blocks"


def loading_servers(prefill_names: Iterable[str]) -> tuple[str, ...]:
    """The servers that check the rows they load: decode (pulled blocks), the
    colocated subject and prefill (offloaded chunks)."""
    return ("decode", "subject", *prefill_names)


def gauge(servers: Mapping[str, VllmServer], server: str, name: str) -> float | None:
    """A Prometheus metric of one server as a float, the series named exactly `name`
    (a selector: it may pin labels) summed over their labels (a gauge such as
    vllm:kv_cache_usage_perc is a fraction); None if unreachable."""
    try:
        return read_total(servers[server].url, name)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def log_count(logs: Path, servers: Collection[str], server: str, needle: str) -> int:
    """Lines of `server`'s log (under `logs`) that contain `needle`; 0 for a server
    the deployment does not run or that has no log yet."""
    log = logs / f"{server}.log"
    if server not in servers or not log.exists():
        return 0
    with log.open(errors="replace") as lines:
        return sum(needle in line for line in lines)
