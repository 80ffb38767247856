"""A deployment that does not come up is started once more (tools/e2e/cluster.py,
Cluster.start): a server without /health in time, or a first P/D request without an
answer, is a timeout; the host's threads and the servers' last log lines go to
stalls.log, the first attempt's logs to attempt-1/, and a second timeout or a server
that exits fails the start. Why it is retried: docs/testing.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.e2e import readiness
from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import ClusterSpec
from tools.e2e.readiness import FIRST_REQUEST_TIMEOUT_S, START_ATTEMPTS


class Attempts:
    """A stand-in for one start of the servers: the outcomes in order, one per call."""

    def __init__(self, outcomes: list[BaseException | None]) -> None:
        self.outcomes = outcomes
        self.calls = 0

    def __call__(self, cluster: Cluster) -> None:
        self.calls += 1
        (cluster.logs / "prefill.log").write_text(f"attempt {self.calls}\n")
        with (cluster.logs / "requests.log").open("a") as log:
            log.write(f"attempt {self.calls}\n")
        outcome = self.outcomes[self.calls - 1]
        if outcome is not None:
            raise outcome


def _cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             outcomes: list[BaseException | None]) -> tuple[Cluster, Attempts]:
    attempts = Attempts(outcomes)
    monkeypatch.setattr(Cluster, "_start_once", lambda self: attempts(self))
    return Cluster(ClusterSpec(tmp_path / "model"), logs=tmp_path / "logs"), attempts


NOT_READY = "vllm serve not ready after 600 s; log prefill.log:\nlast line"


def test_a_start_that_times_out_is_retried_once_with_its_logs_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster, attempts = _cluster(tmp_path, monkeypatch, [TimeoutError(NOT_READY), None])
    first_port = cluster.proxy_port
    cluster.start()
    assert (attempts.calls, cluster.restarts) == (2, 1)
    assert (cluster.logs / "attempt-1" / "prefill.log").read_text() == "attempt 1\n"
    assert (cluster.logs / "prefill.log").read_text() == "attempt 2\n"
    # The harness's request log is appended to across attempts, never moved.
    assert (cluster.logs / "requests.log").read_text() == "attempt 1\nattempt 2\n"
    stalls = (cluster.logs / "stalls.log").read_text()
    assert "start attempt 1 timed out: vllm serve not ready after 600 s; log prefill.log" \
        in stalls
    assert "attempt 2 timed out" not in stalls
    assert cluster.proxy_port != first_port  # the front of the next attempt binds afresh


def test_a_second_timeout_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster, attempts = _cluster(tmp_path, monkeypatch,
                                 [TimeoutError(NOT_READY)] * START_ATTEMPTS)
    with pytest.raises(TimeoutError, match="not ready after 600 s"):
        cluster.start()
    assert attempts.calls == START_ATTEMPTS == 2
    assert (cluster.logs / "stalls.log").read_text().count("timed out") == 2


def test_a_server_that_exits_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster, attempts = _cluster(
        tmp_path, monkeypatch, [RuntimeError("vllm serve exited with code 1"), None])
    with pytest.raises(RuntimeError, match="exited with code 1"):
        cluster.start()
    assert (attempts.calls, cluster.restarts) == (1, 0)
    assert not (cluster.logs / "stalls.log").exists()


def test_a_first_request_without_an_answer_is_a_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_answer(*args: object, **kwargs: object) -> None:
        raise TimeoutError("timed out")

    monkeypatch.setattr(readiness, "post_json", no_answer)
    cluster = Cluster(ClusterSpec(tmp_path / "model"), logs=tmp_path / "logs")
    with pytest.raises(TimeoutError) as raised:
        cluster._first_handshakes()
    assert str(raised.value) == (
        f"first P/D request 1 (NIXL handshake) got no answer in "
        f"{FIRST_REQUEST_TIMEOUT_S:.0f} s: timed out")


def test_a_first_request_answered_with_an_error_is_only_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(readiness, "post_json",
                        lambda *args, **kwargs: (500, {"error": "handshake failed"}))
    Cluster(ClusterSpec(tmp_path / "model"), logs=tmp_path / "logs")._first_handshakes()
    assert "first P/D request (NIXL handshake) 1: HTTP 500: {'error': 'handshake failed'}" \
        in capsys.readouterr().out
