"""The rows-format check a P/D handshake runs (`check_peer_rows_format`, patch
`keep-routed-experts-rows-per-kv-block-in-a-mirror-a`; decode's NIXL handshake calls
it from `transfer-routed-experts-rows-with-the-kv-over-nixl`) refuses a peer with
another rows format, a one-sided rows-transfer switch included. The message names
both sides and the fix. End to end, a one-sided switch on a served P/D pair fails
the same way (tests/v1/kv_connector/test_pd_rows_transfer_e2e.py, in make e2e).
"""

from __future__ import annotations

import pytest

from vllm.distributed.aux_output_connector.rows_transfer import check_peer_rows_format

TINY = "v1 layers=2 top_k=2 dtype=uint8 block_size=32"


def test_the_same_format_on_both_sides_passes() -> None:
    check_peer_rows_format(TINY, TINY, "prefill-0")
    check_peer_rows_format("", "", "prefill-0")  # both off: nothing travels


@pytest.mark.parametrize(
    ("local", "remote", "says"),
    [
        ("", TINY, f"this instance off, the remote {TINY}."),
        (TINY, "", f"this instance {TINY}, the remote off."),
        (TINY, TINY.replace("block_size=32", "block_size=16"), "block_size=16."),
    ],
)
def test_another_format_is_refused_naming_both_sides(
    local: str, remote: str, says: str
) -> None:
    with pytest.raises(RuntimeError) as err:
        check_peer_rows_format(local, remote, "prefill-0")
    message = str(err.value)
    assert message.startswith(
        "routed-experts rows transfer mismatch with remote engine prefill-0: "
    )
    assert says in message
    assert "Set kv_transfer_config.enable_routed_experts_transfer the same" in message
