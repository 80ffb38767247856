"""`vllm kv-transfer-config` against expectations written BY HAND from
docs/deployments/.

Unlike golden/kv_transfer_config.json (a regression snapshot the code wrote), every
expected JSON and message fragment below was written from the docs' rules and
examples, without running the builder: the page and rule each case comes from is
named next to it. A case that fails here means the code and the docs disagree.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.kv_transfer.role_chains_utils import run_cli

GIB_64 = 64 * 1024**3  # "native:64GiB" -> "cpu_bytes_to_use":68719476736 in the docs


def connector(name: str, **extra: Any) -> dict[str, Any]:
    """One connector as the docs print it: kv_role kv_both, its extra config."""
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def multi(*children: dict[str, Any]) -> dict[str, Any]:
    """Several connectors, in order, in a MultiConnector (README, chain rules)."""
    return connector("MultiConnector", connectors=list(children))


NIXL = connector("NixlConnector", num_threads=1)  # README: num_threads 1, first
NATIVE_64 = connector("OffloadingConnector", cpu_bytes_to_use=GIB_64)
MOONCAKE = connector("MooncakeStoreConnector")
MOONCAKE_SAVES = connector("MooncakeStoreConnector", save_decode_cache=True)
HISPARSE_64 = connector("HiSparseConnector", host_pool_gib=64.0)


def mooncake_file(mode: str, segment: int) -> dict[str, Any]:
    """mooncake.md's --emit mooncake-config output with --mooncake-master HEAD:50051."""
    return {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "HEAD:50051",
        "protocol": "rdma",
        "device_name": "",
        "mode": mode,
        "global_segment_size": segment,
    }


MOONCAKE_FLAGS = ["--offload", "mooncake:64GiB", "--decode-offload", "mooncake:0"]
HEAD = ["--mooncake-master", "HEAD:50051"]

# (source in docs/deployments, command line, --kv-transfer-config, Mooncake file)
ACCEPTED: list[tuple[str, list[str], dict[str, Any], dict[str, Any] | None]] = [
    ("1p1d.md: prefill, NIXL alone", ["--role", "prefill"], NIXL, None),
    ("1p1d.md: decode, NIXL alone", ["--role", "decode"], NIXL, None),
    (
        "colocated.md: native CPU offload, printed bare",
        ["--role", "colocated", "--offload", "native:64GiB"],
        NATIVE_64,
        None,
    ),
    (
        "colocated.md: Mooncake store, printed bare, embedded 64 GiB segment",
        ["--role", "colocated", "--offload", "mooncake:64GiB", *HEAD],
        MOONCAKE,
        mooncake_file("embedded", GIB_64),
    ),
    (
        "colocated.md: --save-decode-cache also stores completions' KV",
        [
            "--role",
            "colocated",
            "--offload",
            "mooncake:64GiB",
            "--save-decode-cache",
            *HEAD,
        ],
        MOONCAKE_SAVES,
        mooncake_file("embedded", GIB_64),
    ),
    (
        "native-offload.md: offload on prefill only, prefill's chain",
        ["--role", "prefill", "--prefill-offload", "native:64GiB"],
        multi(NIXL, NATIVE_64),
        None,
    ),
    (
        "native-offload.md: offload on prefill only, decode's chain is NIXL bare",
        ["--role", "decode", "--prefill-offload", "native:64GiB"],
        NIXL,
        None,
    ),
    (
        "native-offload.md: shared offload, off on decode (README: off disables)",
        ["--role", "decode", "--offload", "native:64GiB", "--decode-offload", "off"],
        NIXL,
        None,
    ),
    (
        "native-offload.md: shared offload reaches prefill (README: unset inherits)",
        ["--role", "prefill", "--offload", "native:64GiB", "--decode-offload", "off"],
        multi(NIXL, NATIVE_64),
        None,
    ),
    (
        "mooncake.md: prefill adds 64 GiB to the store, embedded",
        ["--role", "prefill", *MOONCAKE_FLAGS, *HEAD],
        multi(NIXL, MOONCAKE),
        mooncake_file("embedded", GIB_64),
    ),
    (
        (
            "mooncake.md: decode uses the store (0 bytes, standalone-store), saves "
            "decode KV"
        ),
        ["--role", "decode", *MOONCAKE_FLAGS, *HEAD],
        multi(NIXL, MOONCAKE_SAVES),
        mooncake_file("standalone-store", 0),
    ),
    (
        "mooncake.md / README: --no-save-decode-cache switches decode's saves off",
        ["--role", "decode", *MOONCAKE_FLAGS, "--no-save-decode-cache", *HEAD],
        multi(NIXL, MOONCAKE),
        mooncake_file("standalone-store", 0),
    ),
    (
        "hisparse-decode.md: prefill keeps its Mooncake offload",
        ["--role", "prefill", "--prefill-offload", "mooncake:64GiB", *HEAD],
        multi(NIXL, MOONCAKE),
        mooncake_file("embedded", GIB_64),
    ),
    (
        "hisparse-decode.md: decode is NIXL then HiSparse, no offload",
        [
            "--role",
            "decode",
            "--prefill-offload",
            "mooncake:64GiB",
            "--hisparse-host-pool-gib",
            "64",
        ],
        multi(NIXL, HISPARSE_64),
        None,
    ),
]


@pytest.mark.parametrize(
    ("source", "argv", "chain", "mooncake"),
    ACCEPTED,
    ids=[case[0] for case in ACCEPTED],
)
def test_documented_chains(
    source: str, argv: list[str], chain: dict[str, Any], mooncake: dict[str, Any] | None
) -> None:
    result = run_cli(argv)
    assert "error" not in result, result
    assert result["kv_transfer_config"] == chain
    assert result["mooncake_config"] == mooncake


def test_documented_summary_line() -> None:
    """colocated.md: `# (stderr) kv-transfer-config: colocated: native CPU offload
    (64 GiB)`."""
    result = run_cli(["--role", "colocated", "--offload", "native:64GiB"])
    assert result["summary"] == "colocated: native CPU offload (64 GiB)"


OFFLOAD_CLASH = (
    "HiSparseConnector cannot share a kv_transfer_config with {}: HiSparse "
    "keeps KV in a host-resident layout that KV offload does not carry ("
)

# (README validation-table row, command line, fragments the message must contain)
REJECTED: list[tuple[str, list[str], list[str]]] = [
    (
        "native:0 on any role",
        ["--role", "prefill", "--prefill-offload", "native:0"],
        [
            "--prefill-offload native:0",
            "native offload needs a CPU tier",
            "--prefill-offload off",
        ],
    ),
    (
        "Mooncake on every role, all 0 bytes",
        ["--role", "decode", "--offload", "mooncake:0"],
        [
            (
                "Mooncake store: every role using it (prefill, decode) contributes "
                "a 0-byte segment, so the store has no memory. Give at least one "
                "role a segment, e.g. --prefill-offload mooncake:64GiB"
            )
        ],
    ),
    (
        "--save-decode-cache without Mooncake on decode",
        ["--role", "decode", "--offload", "native:64GiB", "--save-decode-cache"],
        [
            (
                "--save-decode-cache: the decode role does not use the Mooncake store, "
                "so there "
                "is no decode KV to save"
            )
        ],
    ),
    (
        "--prefill-offload/--decode-offload on a colocated role",
        ["--role", "colocated", "--offload", "native:64GiB", "--decode-offload", "off"],
        [
            (
                "--decode-offload applies to P/D roles; a colocated instance takes its "
                "offload "
                "from --offload"
            )
        ],
    ),
    (
        "HiSparse asked on the prefill role",
        ["--role", "prefill", "--hisparse-host-pool-gib", "64"],
        [
            "--hisparse-host-pool-gib with --role prefill",
            "builder policy",
            "decode role only",
        ],
    ),
    (
        "HiSparse on a colocated role",
        [
            "--role",
            "colocated",
            "--offload",
            "native:64GiB",
            "--hisparse-host-pool-gib",
            "64",
        ],
        [
            "--hisparse-host-pool-gib with --role colocated",
            "builder policy",
            "--role decode",
        ],
    ),
    (
        (
            "HiSparse + Mooncake store in one chain (mooncake.md: use --decode-offload "
            "off)"
        ),
        ["--role", "decode", *MOONCAKE_FLAGS, "--hisparse-host-pool-gib", "64"],
        [OFFLOAD_CLASH.format("MooncakeStoreConnector"), "--decode-offload off"],
    ),
    (
        "HiSparse + OffloadingConnector in one chain",
        [
            "--role",
            "decode",
            "--offload",
            "native:64GiB",
            "--hisparse-host-pool-gib",
            "64",
        ],
        [OFFLOAD_CLASH.format("OffloadingConnector"), "--decode-offload off"],
    ),
    (
        "HiSparse with host_pool_gib <= 0",
        ["--role", "decode", "--hisparse-host-pool-gib", "0"],
        [
            "HiSparseConnector host_pool_gib must be positive",
            "--hisparse-host-pool-gib 0",
        ],
    ),
    (
        "colocated.md: a colocated role without offload needs no --kv-transfer-config",
        ["--role", "colocated"],
        ["needs no --kv-transfer-config", "--offload native:<bytes>"],
    ),
]


@pytest.mark.parametrize(
    ("row", "argv", "fragments"), REJECTED, ids=[case[0] for case in REJECTED]
)
def test_documented_rejections(row: str, argv: list[str], fragments: list[str]) -> None:
    result = run_cli(argv)  # asserts exit status 2
    assert set(result) == {"error"}, result
    for fragment in fragments:
        assert fragment in result["error"], (fragment, result["error"])
