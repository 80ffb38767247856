# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kv_transfer_params a NIXL decode request must carry.

Contract: a request with ``do_remote_prefill`` names the producer's blocks
with the fields the producer returned (``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``remote_block_ids``
and the optional ones below). ``check_remote_prefill_params`` runs at the API
server before the request reaches the engine and raises ValueError naming the
first field that is missing or malformed. Without it such a request used to
wait for its KV forever: the scheduler logged "Got invalid KVTransferParams"
and never scheduled it, holding its blocks. A request refused at the API
server is still handed to the engine so that the producer's blocks are freed
(``notify_kv_transfer_request_rejected``); ``notifiable_remote_prefill`` keeps
parameters that cannot reach a producer out of that path, where they used to
raise KeyError in the scheduler and kill the engine.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.block_generations import (
    expected_generations,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

FIX = "send the kv_transfer_params the prefill instance returned, unchanged"
REQUIRED_STRINGS = ("remote_engine_id", "remote_request_id", "remote_host")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids_ok(block_ids: Any) -> bool:
    """A list of block ids, or one list of block ids per KV cache group."""
    if not isinstance(block_ids, (list, tuple)):
        return False
    if all(_is_int(b) and b >= 0 for b in block_ids):
        return True
    return all(
        isinstance(group, (list, tuple)) and all(_is_int(b) and b >= 0 for b in group)
        for group in block_ids
    )


def _refuse(field: str, want: str, params: dict[str, Any]) -> ValueError:
    got = repr(params[field]) if field in params else "nothing"
    return ValueError(f"kv_transfer_params.{field} must be {want}, got {got}; {FIX}")


def check_remote_prefill_params(params: dict[str, Any]) -> None:
    """Raise ValueError if a decode request's NIXL parameters are unusable."""
    if not params.get("do_remote_prefill"):
        return
    for field in REQUIRED_STRINGS:
        if not isinstance(params.get(field), str) or not params[field]:
            raise _refuse(field, "a non-empty string", params)
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        raise _refuse("remote_port", "a port number (1-65535)", params)
    if not _block_ids_ok(params.get("remote_block_ids")):
        raise _refuse(
            "remote_block_ids",
            "a list of non-negative block ids (one list per KV cache group)",
            params,
        )
    for field, minimum in (("tp_size", 1), ("dcp_size", 1), ("pp_size", 1)):
        value = params.get(field, minimum)
        if not _is_int(value) or value < minimum:
            raise _refuse(field, f"an integer >= {minimum}", params)
    for field, minimum in (
        ("remote_num_tokens", 0),
        ("remote_block_size", 1),
        ("remote_registration_generation", 0),
    ):
        value = params.get(field)
        if value is not None and (not _is_int(value) or value < minimum):
            raise _refuse(field, f"an integer >= {minimum} when given", params)
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (
        not isinstance(expiry, (int, float)) or isinstance(expiry, bool)
    ):
        raise _refuse("remote_blocks_expiry_time", "a number when given", params)
    expected_generations(params)  # raises ValueError naming the field


def notifiable_remote_prefill(request_id: str, params: dict[str, Any]) -> bool:
    """Whether a decode request that ends before its pull can tell the producer
    to free its blocks; logs why not."""
    try:
        check_remote_prefill_params(params)
    except ValueError as e:
        logger.warning(
            "Request %s ended before its KV pull and cannot notify its producer: %s",
            request_id,
            e,
        )
        return False
    return True
