"""End to end on CPU: vLLM's file-system offload tier serves KV across a server
restart with routed experts on (patch
`run-the-native-offload-worker-on-the-cpu-platform`).

TieringOffloadingSpec with an `fs` secondary tier: the first server computes a
200-token prompt and its chunks reach the tier's files; a new server process on the
same directory loads them. Rows are asked from position 160, so the routed-experts
load limit (patch `bound-offload-loads-to-positions-without-routed`) lets the load
reach floor(160 / 32) * 32 = 160 tokens: the restarted server must load exactly 160
tokens from the tier and return the first run's tokens and rows. The negative
control zeroes the tier's files before a third start: the same load then brings
wrong KV, and the comparison must see different rows.

Full scenario (three server starts): `make e2e`, not `make test`; the slot rule that
lets the tier start on CPU is unit-tested in tests/v1/kv_offload.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tools.testbed.cpu_server import VllmServer, cpu_env, npy_rows
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_full, pytest.mark.timeout(1200)]

BLOCK = 32
PROMPT = [(7 * i) % 400 + 5 for i in range(200)]  # 6 full blocks
PROMPT_START = 160
LOADED = PROMPT_START // BLOCK * BLOCK
LOADED_METRIC = "vllm:external_prefix_cache_hits_total"


def _server(
    model: Path, tier: Path, log: Path, rows_travel: bool = False
) -> VllmServer:
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "enable_routed_experts_transfer": rows_travel,
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 26,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(tier),
                    "n_read_threads": 2,
                    "n_write_threads": 2,
                }
            ],
        },
    }
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
            json.dumps(config),
        ),
        env=cpu_env(opt_in=True),
    )


def _ask(server: VllmServer, start: int = PROMPT_START) -> tuple[str, str, int]:
    """(text, rows, tokens loaded by the connector) for the prompt, rows from
    ``start``."""
    body = {
        "model": server.served_name,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "routed_experts_prompt_start": start,
    }
    choice = server.complete(body)["choices"][0]
    assert choice["routed_experts_start"] == start
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    loaded = sum(
        float(line.rpartition(" ")[2])
        for line in metrics.splitlines()
        if line.startswith(LOADED_METRIC)
    )
    return choice["text"], choice["routed_experts"], int(loaded)


def _chunk_files(tier: Path) -> list[Path]:
    return sorted(tier.rglob("*.bin"))


def _wait_for_files(tier: Path, count: int, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while len(_chunk_files(tier)) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(_chunk_files(tier)) >= count, _chunk_files(tier)


def test_the_fs_tier_serves_kv_across_a_restart(tmp_path: Path) -> None:
    model = tmp_path / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    tier = tmp_path / "tier"
    with _server(model, tier, tmp_path / "first.log") as first:
        text, rows, loaded = _ask(first)
        assert loaded == 0
        # The six full blocks reach the files once their stores cascade.
        _wait_for_files(tier, len(PROMPT) // BLOCK)
    with _server(model, tier, tmp_path / "second.log") as second:
        again = _ask(second)
    assert again == (text, rows, LOADED), (again[2], again[0], text)

    # Negative control: the same load from zeroed files must not pass the check.
    for path in _chunk_files(tier):
        path.write_bytes(bytes(path.stat().st_size))
    with _server(model, tier, tmp_path / "third.log") as third:
        wrong_text, wrong_rows, wrong_loaded = _ask(third)
    assert wrong_loaded == LOADED
    assert wrong_rows != rows


# Rows that travel with the chunks (patch
# `carry-routed-experts-rows-through-secondary-offload`): each chunk row holds
# the block's KV, then its rows slot. By hand from tools/testbed/tiny_moe.py:
# K and V x 32 tokens x 2 KV heads x head_dim 32 x 4 bytes (float32) x 2 layers
# = 32,768 bytes of KV, then 32 positions x 2 layers x top-2 uint8 = 128 bytes of
# rows and a 32-byte tag.
KV_BYTES = 2 * BLOCK * 2 * 32 * 4 * 2
ROWS_BYTES = BLOCK * 2 * 2
SLOT_BYTES = ROWS_BYTES + 32
FULL_BLOCKS = len(PROMPT) // BLOCK * BLOCK  # every full block: 192 tokens


def test_rows_travel_through_the_fs_tier_across_a_restart(tmp_path: Path) -> None:
    model = tmp_path / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    tier = tmp_path / "tier"
    with _server(model, tier, tmp_path / "first.log", rows_travel=True) as first:
        text, rows, loaded = _ask(first, start=0)
        assert loaded == 0
        _wait_for_files(tier, len(PROMPT) // BLOCK)
    # The files hold the rows the first run returned, one block each.
    returned = npy_rows(rows)
    assert returned.shape[1:] == (2, 2) and len(returned) >= FULL_BLOCKS
    expected = {
        returned[i : i + BLOCK].astype(np.uint8).tobytes()
        for i in range(0, FULL_BLOCKS, BLOCK)
    }
    in_files = {
        path.read_bytes()[KV_BYTES : KV_BYTES + ROWS_BYTES]
        for path in _chunk_files(tier)
    }
    assert in_files == expected
    with _server(model, tier, tmp_path / "second.log", rows_travel=True) as second:
        again = _ask(second, start=0)
    assert again == (text, rows, FULL_BLOCKS), (again[2], again[0], text)

    # Negative control: the rows slots zeroed in the files. The KV still loads
    # nowhere past the first block whose rows are missing (here: none loads), and
    # the rows returned are computed afresh, equal to the first run's.
    for path in _chunk_files(tier):
        data = bytearray(path.read_bytes())
        data[KV_BYTES : KV_BYTES + SLOT_BYTES] = bytes(SLOT_BYTES)
        path.write_bytes(bytes(data))
    with _server(model, tier, tmp_path / "third.log", rows_travel=True) as third:
        wrong = _ask(third, start=0)
    assert wrong == (text, rows, 0), (wrong[2], wrong[0], text)
