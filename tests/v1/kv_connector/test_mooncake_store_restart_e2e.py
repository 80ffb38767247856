"""End to end on CPU: routed-experts rows stored beside Mooncake store chunks serve a
new server process (patch `store-routed-experts-rows-beside-mooncake-store`).

A `mooncake_master` and Mooncake's standalone client (`mooncake_client`, holding the
store's memory) outlive three colocated servers started one after the other, each
with `MooncakeStoreConnector` and `enable_routed_experts_transfer`, and no store
memory of its own. Every request asks for every row (routed_experts_prompt_start =
0) of a 200-token prompt:

- the first server computes it; its six full blocks reach the store, each as its KV
  object and its rows object (the master then counts 12 keys);
- a new server process loads the six blocks (192 tokens) from the store and must
  return the first run's tokens and rows;
- the negative control: a third server whose loads do not hand the rows to the
  capture (the harness's `rows-not-imported` fault). The check must see it: the
  server refuses the request (the aux-output store's fail-closed path: HTTP 500 and
  `BlockObjectStoreError` in its log, as measured) or returns other rows.

Without the switch a server loads nothing here (the load limit of patch
`bound-offload-loads-to-positions-without-routed`, tests/v1/kv_connector/unit/
test_mooncake_store_aux_output_clamp.py). Needs the Mooncake store
(tools/setup-mooncake.sh): `make e2e`, not `make test`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.testbed.cpu_server import VllmServer, cpu_env
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_store, pytest.mark.timeout(1500)]

BLOCK = 32
PROMPT = [(11 * i) % 400 + 5 for i in range(200)]
FULL_BLOCKS = len(PROMPT) // BLOCK  # 6 chunks: 192 tokens
LOADED_METRIC = "vllm:external_prefix_cache_hits_total"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[object]:
    from tools.e2e.mooncake_master import MooncakeMaster, SegmentHolder

    master = MooncakeMaster(tmp_path / "store")
    master.start()
    holder = SegmentHolder(master)
    try:
        holder.start()
        yield master
    finally:
        holder.stop()
        master.stop()


def _server(
    model: Path, master: object, log: Path, fault: str | None = None
) -> VllmServer:
    from vllm.distributed.kv_transfer.role_chains import (
        Deployment,
        build_role_config,
        parse_offload,
    )

    deployment = Deployment(
        pd=False,
        offload=parse_offload("mooncake:64MiB", "--offload"),
        routed_experts_transfer=True,
    )
    config = build_role_config(deployment, "colocated", master.client())  # type: ignore[attr-defined]
    assert config.mooncake_config is not None
    # The segment holder gives the store its memory: a server that gave its own
    # would take its objects with it when it stops.
    client = {
        **config.mooncake_config,
        "mode": "standalone-store",
        "global_segment_size": 0,
    }
    client_path = log.with_suffix(".mooncake.json")
    client_path.write_text(json.dumps(client))
    env = cpu_env(opt_in=True)
    env["MOONCAKE_CONFIG_PATH"] = str(client_path)
    if fault is not None:
        from tools.e2e.role_servers import FAULTS_DIR

        env["E2E_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(FAULTS_DIR), os.environ.get("PYTHONPATH")])
        )
    return VllmServer(
        model=model,
        log_path=log,
        extra_args=(
            "--enable-return-routed-experts",
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--kv-transfer-config",
            json.dumps(config.kv_transfer_config),
        ),
        env=env,
    )


def _loaded(server: VllmServer) -> int:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    return int(
        sum(
            float(line.rpartition(" ")[2])
            for line in metrics.splitlines()
            if line.startswith(LOADED_METRIC)
        )
    )


def _ask(server: VllmServer) -> tuple[str, str, int]:
    """(text, rows, tokens loaded by the connector) for the prompt, every row."""
    body = {
        "model": server.served_name,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "routed_experts_prompt_start": 0,
    }
    choice = server.complete(body)["choices"][0]
    assert choice["routed_experts_start"] == 0
    return choice["text"], choice["routed_experts"], _loaded(server)


def _wait_for_keys(master: object, count: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    keys = master.key_count()  # type: ignore[attr-defined]
    while keys < count and time.monotonic() < deadline:
        time.sleep(0.5)
        keys = master.key_count()  # type: ignore[attr-defined]
    return keys


def test_rows_in_the_store_serve_a_new_server_process(
    tmp_path: Path, store: object
) -> None:
    model = tmp_path / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    with _server(model, store, tmp_path / "first.log") as first:
        text, rows, loaded = _ask(first)
        assert loaded == 0
        # Each full block: one KV object (TP 1) and one rows object.
        keys = _wait_for_keys(store, 2 * FULL_BLOCKS)
        assert keys == 2 * FULL_BLOCKS, keys
    with _server(model, store, tmp_path / "second.log") as second:
        again = _ask(second)
    assert again == (text, rows, FULL_BLOCKS * BLOCK), (again[2], again[0], text)

    # Negative control: the same loads, with the rows never handed to the capture.
    with _server(
        model, store, tmp_path / "third.log", fault="rows-not-imported"
    ) as third:
        try:
            wrong: tuple[str, str, int] | None = _ask(third)
        except RuntimeError as e:  # VllmServer.complete: an HTTP error
            assert "HTTP 500" in str(e), e
            wrong = None
    if wrong is not None:
        assert wrong[2] == FULL_BLOCKS * BLOCK and wrong[1] != rows, wrong[2]
    else:
        log = (tmp_path / "third.log").read_text()
        assert "BlockObjectStoreError" in log
