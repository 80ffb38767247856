"""The harness's abort-mid-store scenarios (python -m tools.e2e): turn 1 of
each conversation is hung up on and not compared, turn 2 is, and a server whose KV
cache is still in use once every request finished is a failure. A fake deployment
stands in for the servers: what is tested is the harness's bookkeeping; the served
runs are in tests/v1/kv_connector/test_abort_mid_store_e2e.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tools.e2e import harness
from tools.e2e.scenarios import FULL, REDUCED, Req, Scenario


@dataclass
class FakeServer:
    url: str


@dataclass
class FakeCluster:
    """What the harness reads of a deployment: servers, the URL scenarios go to,
    and each server's KV cache usage as /metrics would report it."""

    usage: dict[str, list[float]]
    servers: dict[str, FakeServer] = field(default_factory=dict)
    url: str = "http://deployment"
    spec: Any = None
    logs: Path = Path()  # where the harness writes requests.log
    reference_answers: Any = None  # the reference is asked, not recorded
    only_reference: bool = False

    def __post_init__(self) -> None:
        self.servers = {name: FakeServer(f"http://{name}") for name in self.usage}

    def gauge(self, server: str, name: str) -> float | None:
        assert name == "vllm:kv_cache_usage_perc"
        readings = self.usage[server]
        return readings.pop(0) if len(readings) > 1 else readings[0]


def test_every_offload_deployment_has_an_abort_scenario_in_make_e2e() -> None:
    aborts = {s.group: s for s in FULL if s.abort_first}
    assert set(aborts) == {"offload-colocated", "offload-pd", "mooncake-pd"}
    for scenario in aborts.values():
        # Turn 2 resends the aborted prompt and is checked; the twin sees none of it.
        assert (scenario.turns, scenario.resend, scenario.twin) == (2, True, False)
    assert not any(s.abort_first for s in REDUCED)


def test_kv_still_in_use_after_the_requests_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    # decode frees its blocks on the second reading; subject never does.
    cluster = FakeCluster({"decode": [0.25, 0.0], "subject": [0.125], "reference": [0.0]})
    held = harness.held_kv_blocks(cluster, wait_s=0.05)  # type: ignore[arg-type]
    assert held == {"subject": 0.125}
    result = harness.Result(Scenario("x-abort", "offload-colocated", (Req(5),),
                                     abort_first=True))
    result.held_kv = held
    assert result.mismatches == 1
    assert any("KV blocks are still held (vllm:kv_cache_usage_perc: subject 12.50%)" in n
               for n in harness.result_notes(result))


def test_an_idle_deployment_holds_nothing() -> None:
    cluster = FakeCluster({"prefill": [0.0], "decode": [0.0]})
    assert harness.held_kv_blocks(cluster, wait_s=0.0) == {}  # type: ignore[arg-type]
    result = harness.Result(Scenario("x-abort", "offload-colocated", (Req(5),),
                                     abort_first=True))
    assert result.mismatches == 0


def test_the_aborted_turn_is_hung_up_on_and_only_the_resent_one_is_compared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[str, str]] = []
    answer = {"choices": [{"token_ids": [7, 8]}]}

    def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        sent.append(("post", url))
        return answer

    def compare(pd: dict[str, Any], reference: dict[str, Any], *args: Any) -> str:
        sent.append(("compare", ""))
        return "compared"

    monkeypatch.setattr(harness, "post", post)
    monkeypatch.setattr(harness, "compare", compare)
    monkeypatch.setattr(harness, "hang_up",
                        lambda url, body: sent.append(("hang up", url)))
    cluster = FakeCluster({"reference": [0.0], "subject": [0.0]}, logs=tmp_path)
    cluster.spec = type("Spec", (), {"topology": "colocated", "rows_oracle_margin": None})
    scenario = Scenario("x-abort", "offload-colocated", (Req(5, max_tokens=2),),
                        turns=2, resend=True, abort_first=True, twin=False)
    conversation = harness.Conversation(scenario.requests[0], [4, 5, 6, 7, 8])
    outcomes = harness._run_conversation(cluster, scenario, conversation)  # type: ignore[arg-type]
    assert outcomes == ["compared"]
    assert sent == [
        ("post", "http://reference"), ("hang up", "http://deployment"),
        ("post", "http://reference"), ("post", "http://deployment"), ("compare", ""),
    ]
    assert conversation.ids == [4, 5, 6, 7, 8]  # resent as it was
