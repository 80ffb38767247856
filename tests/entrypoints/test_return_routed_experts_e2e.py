"""Where rows reach clients, served on CPU: the per-request switch
`return_routed_experts` (patch `let-a-request-skip-or-require-its-routed-experts`) and
rows in streaming responses (patch
`return-routed-experts-rows-in-the-final-stream-chunk`).

One `vllm serve` with --enable-return-routed-experts and one without. On the first,
for /v1/completions, /v1/chat/completions and the token-in/token-out generate
endpoint: the default returns rows, `false` returns none (same tokens), `true` returns
the same rows as the default. Streamed, each choice's final chunk carries rows equal
to the non-streaming ones (n = 2 included) and no other chunk carries any. On the
second, `true` and a `routed_experts_prompt_start` are HTTP 400 naming the flag and the
server keeps serving; the default and `false` are answered without rows. A start that is
negative, past the prompt or not an integer is HTTP 400 naming the field.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tools.testbed.cpu_server import (
    VllmServer,
    choice_rows,
    cpu_env,
    final_chunk_rows,
    final_chunk_starts,
    post_json,
    post_stream,
)
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPT = [(13 * i) % 400 + 4 for i in range(21)]
MAX_TOKENS = 4


def completion(switch: bool | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    if switch is not None:
        body["return_routed_experts"] = switch
    return "/v1/completions", body


def chat(switch: bool | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "messages": [{"role": "user", "content": "w12 w40 w7"}],
    }
    if switch is not None:
        body["return_routed_experts"] = switch
    return "/v1/chat/completions", body


def generate(switch: bool | None) -> tuple[str, dict[str, Any]]:
    params: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0}
    if switch is not None:
        params["return_routed_experts"] = switch
    return "/inference/v1/generate", {
        "model": "tiny",
        "token_ids": PROMPT,
        "sampling_params": params,
    }


def rows_and_tokens(response: dict[str, Any]) -> tuple[np.ndarray | None, Any]:
    choice = response["choices"][0]
    rows = choice_rows(choice)
    tokens = choice.get("token_ids") or choice.get("message", {}).get("content")
    return rows, tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    # The tiny tokenizer has no chat template.
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    return path


def serve_args(model_dir: Path) -> tuple[str, ...]:
    """--enable-scale-out serves the token-in/token-out generate endpoint."""
    return (
        "--dtype",
        "float32",
        "--enable-scale-out",
        "--chat-template",
        str(model_dir / "chat_template.jinja"),
    )


@pytest.fixture(scope="module")
def with_flag(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = VllmServer(
        model=model_dir,
        log_path=tmp_path_factory.mktemp("logs") / "flag.log",
        extra_args=("--enable-return-routed-experts", *serve_args(model_dir)),
        env=cpu_env(opt_in=True),
    )
    with server:
        yield server


@pytest.mark.parametrize("endpoint", [completion, chat, generate])
def test_the_switch_on_a_server_with_rows(with_flag: VllmServer, endpoint: Any) -> None:
    results = {}
    for switch in (None, False, True):
        code, response = post_json(with_flag.url, *endpoint(switch))
        assert code == 200, response
        results[switch] = rows_and_tokens(response)
    default_rows, default_tokens = results[None]
    assert default_rows is not None and default_rows.shape[1:] == (2, 2)
    assert results[False][0] is None  # opted out: no rows ...
    assert results[False][1] == default_tokens  # ... the same answer
    assert results[True][1] == default_tokens
    np.testing.assert_array_equal(results[True][0], default_rows)


def test_requiring_rows_without_the_flag_is_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    server = VllmServer(
        model=model_dir,
        log_path=tmp_path / "plain.log",
        extra_args=serve_args(model_dir),
        env=cpu_env(opt_in=True),
    )
    with server:
        for endpoint in (completion, chat, generate):
            code, response = post_json(server.url, *endpoint(True))
            assert code == 400, response
            text = json.dumps(response)
            assert "return_routed_experts" in text
            assert "--enable-return-routed-experts" in text
            # A start selects rows too: refused the same way, unless opted out.
            path, body = endpoint(None)
            start = {"routed_experts_prompt_start": 5}
            if path == "/inference/v1/generate":
                body["sampling_params"] |= start
            else:
                body |= start
            code, response = post_json(server.url, path, body)
            assert code == 400, response
            text = json.dumps(response)
            assert "routed_experts_prompt_start=5" in text
            assert "--enable-return-routed-experts" in text
            for switch in (None, False):  # still serving, without rows
                code, response = post_json(server.url, *endpoint(switch))
                assert code == 200, response
                assert rows_and_tokens(response)[0] is None


@pytest.mark.parametrize(
    ("start", "says"),
    [
        (-1, "greater than or equal to 0"),
        (len(PROMPT) + 1, "between 0 and the prompt length (21)"),
        ("five", "valid integer"),
        ("3", "valid integer"),
        (2.5, "valid integer"),
        (True, "valid integer"),  # not read as 1
    ],
)
def test_a_bad_prompt_start_names_the_field(
    with_flag: VllmServer, start: Any, says: str
) -> None:
    path, body = completion(None)
    code, response = post_json(
        with_flag.url, path, body | {"routed_experts_prompt_start": start}
    )
    assert code == 400, response
    assert "routed_experts_prompt_start" in json.dumps(response)
    assert says in json.dumps(response)
    # The server keeps serving, and the edges of the range are accepted.
    for good in (0, len(PROMPT)):
        code, response = post_json(
            with_flag.url, path, body | {"routed_experts_prompt_start": good}
        )
        assert code == 200, response
        rows, _ = rows_and_tokens(response)
        assert rows is not None and len(rows) == len(PROMPT) + MAX_TOKENS - 1 - good
        assert response["choices"][0]["routed_experts_start"] == good


def assert_stream_matches(chunks: list[dict[str, Any]], response: dict) -> None:
    """Each choice's final chunk carries the non-streaming choice's rows and
    start, for both choices."""
    want = {c["index"]: choice_rows(c) for c in response["choices"]}
    starts = {c["index"]: c["routed_experts_start"] for c in response["choices"]}
    got = final_chunk_rows(chunks)
    assert sorted(got) == [0, 1]
    assert final_chunk_starts(chunks) == starts
    for index, rows in got.items():
        assert rows is not None
        np.testing.assert_array_equal(rows, want[index])


@pytest.mark.parametrize("endpoint", [completion, chat])
def test_streamed_rows_equal_the_non_streaming_rows(
    with_flag: VllmServer, endpoint: Any
) -> None:
    path, body = endpoint(None)
    # Sampled with a seed: two different choices, the same ones streamed.
    body = body | {"n": 2, "seed": 7, "temperature": 0.8}
    code, response = post_json(with_flag.url, path, body)
    assert code == 200, response
    chunks = post_stream(with_flag.url, path, body)
    assert_stream_matches(chunks, response)
    # Negative control: the same stream with a final chunk's start one position
    # late (rows labelled with the wrong positions) fails the check.
    shifted = copy.deepcopy(chunks)
    final = next(
        c for chunk in shifted for c in chunk["choices"] if c.get("finish_reason")
    )
    final["routed_experts_start"] += 1
    with pytest.raises(AssertionError):
        assert_stream_matches(shifted, response)
    # Opted out: no chunk carries rows.
    path, body = endpoint(False)
    assert final_chunk_rows(post_stream(with_flag.url, path, body)) == {0: None}
