"""The harness's request trace (python -m tools.e2e): each request a scenario sends is
written to its deployment's requests.log when it leaves and when it is answered, so a
run that overstays its timeout can be read against the servers' logs afterwards."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.e2e import harness


@dataclass
class FakeCluster:
    logs: Path


def test_each_request_is_logged_when_sent_and_when_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: dict[str, dict[str, Any]] = {
        "http://reference": {"choices": []},
        "http://proxy": {"error": "HTTP 500: decode failed"},
    }
    seen: list[str] = []

    def fake_post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        # The "sent" line is on disk before the request is.
        seen.append((tmp_path / harness.REQUESTS_LOG).read_text())
        return answers[url]

    monkeypatch.setattr(harness, "post", fake_post)
    cluster = FakeCluster(tmp_path)
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 7}
    assert harness.traced_post(cluster, "reference", "http://reference", body) == {  # type: ignore[arg-type]
        "choices": []}
    assert harness.traced_post(cluster, "P/D", "http://proxy", body) == answers["http://proxy"]  # type: ignore[arg-type]

    lines = (tmp_path / harness.REQUESTS_LOG).read_text().splitlines()
    assert seen[0].splitlines() == lines[:1]
    clock = r"\d\d:\d\d:\d\d"
    assert re.fullmatch(rf"{clock} -> reference: 5 prompt tokens, max_tokens 7", lines[0])
    assert re.fullmatch(rf"{clock} <- reference: ok in \d+\.\d s", lines[1])
    assert re.fullmatch(rf"{clock} -> P/D: 5 prompt tokens, max_tokens 7", lines[2])
    assert re.fullmatch(rf"{clock} <- P/D: HTTP 500: decode failed in \d+\.\d s", lines[3])
    assert len(lines) == 4
