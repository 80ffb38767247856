"""What the entry points that drive a P/D pair by hand share (prefill_lost,
lease_expiry, soak): they play the router between prefill's hand-off and decode's
read, kill servers, and read decode's counters afterwards.

Entry points import from here, never from each other.
"""

from __future__ import annotations

import os
import signal
import time

from tools.e2e.cluster import Cluster

STATS_WAIT_SECONDS = 12  # vLLM's Prometheus counters follow its 10 s stats interval
# What decode's error for a failed KV load must say (the scheduler's
# kv_load_failure_errors): the policy, and the cause NixlConnector gave.
KV_LOAD_FAILED_HINT = "kv_load_failure_policy is 'fail'"
# Prompt tokens decode computed itself (a metrics selector, tools/testbed/metrics.py).
LOCAL_COMPUTE = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'


def kill_server(cluster: Cluster, name: str) -> None:
    """SIGKILL a server's process group (API server, engine core, workers) and wait."""
    process = cluster.servers[name].process
    assert process is not None
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    time.sleep(2)  # let the kernel close its sockets: decode must see a dead peer
