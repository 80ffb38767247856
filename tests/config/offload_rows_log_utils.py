"""What the routed-experts policy logs at startup about a KV offload connector that
could carry rows but runs without enable_routed_experts_transfer: a capture of its
warnings and the cost message it must print (patch
carry-routed-experts-rows-with-offloaded-kv-chunks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.config.aux_gate_utils import LogRecords
from vllm import logger as vllm_logger


@contextmanager
def policy_warnings() -> Iterator[LogRecords]:
    """The messages the rows-transfer policy logs inside the block."""
    from vllm.distributed.aux_output_connector import rows_transfer_policy

    # warning_once remembers what it printed for the whole process.
    vllm_logger._print_warning_once.cache_clear()
    handler = LogRecords()
    rows_transfer_policy.logger.addHandler(handler)
    try:
        yield handler
    finally:
        rows_transfer_policy.logger.removeHandler(handler)


def offload_cost_warning(name: str) -> str:
    return (
        f"{name} runs without enable_routed_experts_transfer: its chunks carry no "
        "routed-experts rows, so its loads stop at the KV block holding a request's "
        "routed_experts_prompt_start (a request that asks for rows from position 0 "
        'gets no hits from it). Set "enable_routed_experts_transfer": true in its '
        "kv_transfer_config (and on the MultiConnector's) to store the rows with "
        "the chunks (not for hybrid attention + Mamba models, which keep bounded "
        "loads)."
    )
