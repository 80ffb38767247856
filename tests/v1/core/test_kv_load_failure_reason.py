"""A request that fails because its KV could not be loaded says so.

With kv_load_failure_policy="fail", the scheduler finishes such a request with
an error; its EngineCoreOutput carries error=RequestError whose message names the
cause the KV connector gave (KVConnectorOutput.load_failure_causes), the policy
and the fix, instead of "Internal server error" (the API server raises it:
tests/v1/entrypoints/test_kv_load_failure_message.py). Driven through a real
Scheduler with a NixlConnector kv_consumer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.aux_scheduler_utils import (
    nixl_decode_scheduler,
    plain_runner_output,
)
from tests.v1.core.kv_load_failure_utils import remote_request
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import KVConnectorOutput

pytestmark = pytest.mark.usefixtures("scheduler_env")

POLICY = (
    "kv_transfer_config.kv_load_failure_policy is 'fail': retry the request, or "
    "set kv_load_failure_policy to 'recompute' to compute the prompt locally."
)


def fail_the_pull(
    scheduler, rid: str, causes: dict[str, str] | None = None
) -> tuple[list, list[str]]:
    """The request waits for its KV, then the worker reports the pull failed
    (with `causes`). Returns the engine outputs of that step and the next, and
    the requests the next step scheduled."""
    out = scheduler.schedule()
    failed = KVConnectorOutput(
        finished_recving={rid}, failed_recving={rid}, load_failure_causes=causes or {}
    )
    engine = scheduler.update_from_output(out, plain_runner_output(out, failed))
    outputs = [o for batch in engine.values() for o in batch.outputs]
    out = scheduler.schedule()
    engine = scheduler.update_from_output(out, plain_runner_output(out))
    outputs += [o for batch in engine.values() for o in batch.outputs]
    return outputs, list(out.num_scheduled_tokens)


def test_fail_policy_reports_the_kv_load_failure(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir, "fail", aux=False)
    scheduler.add_request(remote_request("d"))
    outputs, scheduled = fail_the_pull(scheduler, "d")
    [output] = [o for o in outputs if o.finished]
    assert scheduled == []
    assert output.request_id == "d"
    assert output.finish_reason == FinishReason.ERROR
    assert output.stop_reason is None
    assert output.error is not None
    assert (output.error.code, output.error.message) == (
        "kv_load_failed",
        (
            "The KV cache of this request could not be loaded: the KV connector did "
            f"not say why. {POLICY}"
        ),
    )
    assert "d" not in scheduler.requests


def test_the_error_names_the_cause_the_connector_gave(model_dir: Path) -> None:
    scheduler = nixl_decode_scheduler(model_dir, "fail", aux=False)
    scheduler.add_request(remote_request("d"))
    cause = "the NIXL READ of its KV failed"
    outputs, _ = fail_the_pull(scheduler, "d", {"d": cause, "other": "not d's"})
    [output] = [o for o in outputs if o.finished]
    assert output.error is not None
    assert output.error.message == (
        f"The KV cache of this request could not be loaded: {cause}. {POLICY}"
    )


def test_recompute_policy_does_not_fail_the_request(model_dir: Path) -> None:
    """Negative control: the same failure under recompute finishes nothing."""
    scheduler = nixl_decode_scheduler(model_dir, "recompute", aux=False)
    scheduler.add_request(remote_request("d"))
    outputs, scheduled = fail_the_pull(scheduler, "d")
    assert [o for o in outputs if o.finished] == []
    assert scheduled == ["d"]  # computed locally, from the first token
    assert [o.error for o in outputs] == [None]
