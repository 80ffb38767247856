# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Auxiliary outputs of requests under disaggregated prefill/decode (P/D).

Contract:
- The prefill instance computes the prompt and returns its rows. The decode
  instance receives the prompt's KV blocks and never computes them, so it
  returns rows only from its own first forward on (the decode emit floor kept
  by ``AuxOutputSchedulerConnector``). A client merges both by position.
- A decode request is recognised by its ``kv_transfer_params``: it names the
  prefill engine (``remote_engine_id``) and does not send KV itself
  (``do_remote_decode`` is falsy). NIXL updates the params in place after the
  pull, and the marker survives that update and preemption.

Which connectors may carry P/D requests with auxiliary outputs on is decided
at startup by ``connector_policy.py``.
"""

from collections.abc import Mapping
from typing import Any


def is_pd_decode_request(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    """Whether a request is the decode half of a P/D request."""
    if not kv_transfer_params:
        return False
    return kv_transfer_params.get(
        "remote_engine_id"
    ) is not None and not kv_transfer_params.get("do_remote_decode")


def is_pd_prefill_request(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    """Whether a request is the prefill half of a P/D request (a hand-off)."""
    return bool(kv_transfer_params and kv_transfer_params.get("do_remote_decode"))


# Set by the decode instance's KV connector on a P/D decode request whose
# prompt rows it pulls with the KV (enable_routed_experts_transfer). Such a
# request returns rows from routed_experts_prompt_start, like any request.
ROWS_WITH_KV = "routed_experts_rows_with_kv"


def mark_rows_with_kv(kv_transfer_params: dict[str, Any], rows_with_kv: bool) -> None:
    """Record on a P/D decode request whether its prompt rows come with its KV.

    The mark outlives the pull: a recompute after a failed load, or a
    preemption, may load the prefix again through another connector (an
    offload tier, the Mooncake store) whose blocks have no rows.
    """
    kv_transfer_params[ROWS_WITH_KV] = rows_with_kv


def emits_from_first_forward(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    """Whether a request returns rows only from its first forward here: a P/D
    decode request whose prompt rows do not travel with its KV."""
    return is_pd_decode_request(kv_transfer_params) and not (
        kv_transfer_params and kv_transfer_params.get(ROWS_WITH_KV)
    )
