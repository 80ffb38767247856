"""Every endpoint returns colocated rows under P/D, streamed and not.

    python -m tools.e2e.pd_endpoints [--mode proxy-merge|rows-over-nixl]
                                     [--router pdproxy|vllm-router]
                                     [--fault F | --no-routed-experts-transfer]
                                     [--reduced] [--workdir DIR]

A P/D pair of the installed fork on the harness's tiny MoE, a colocated reference
beside it, and a front end:
- `--mode proxy-merge` (default): rows do not travel with the KV; `vllm-r3-pdproxy`
  merges prefill's and decode's rows by position (non-streamed, and on each streamed
  choice's final chunk);
- `--mode rows-over-nixl`: rows travel with the KV (`--routed-experts-transfer` on
  both roles), so decode's response is complete and any front end returns it: checked
  through the real `vllm-router` and through the proxy (which then finds nothing to
  add).

For /v1/completions, /v1/chat/completions and the token-in/token-out
/inference/v1/generate (served with --enable-scale-out), for rows from 0 and from
inside the second block, the P/D answer must equal the reference's non-streaming
answer (`--reduced`: rows from inside the second block only, the harder case and
half the requests): the same tokens, `routed_experts_start` = the request's
`routed_experts_prompt_start`, the same rows. Streamed (n = 2 on every endpoint and
front, sampled with a seed: an RL group, prefilled once and read once), each choice's
final chunk carries the rows of the reference's choice and no earlier chunk any. Exit 0 only when
every check holds; the last line is the summary.

Negative controls (the run must exit 1): `--fault shift-decode-rows` plants shifted
rows on decode (the merge then returns rows that differ from the reference);
`--no-routed-experts-transfer` with `--mode rows-over-nixl` turns the switch off on
both roles, so decode holds only its own rows and a front end that forwards decode's
answer returns incomplete rows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from vllm.entrypoints.routed_experts import RoutedExpertsError

from tools.testbed.aliases import (
    PROXY_MERGE,
    ROWS_OVER_NIXL,
    deprecated_alias,
    deprecated_values,
)
from tools.testbed.cpu_server import (
    choice_rows,
    final_chunk_rows,
    free_port,
    post_json,
    post_stream,
    stop_process_group,
)
from tools.testbed.tiny_moe import build, word
from tools.e2e import fault_registry
from tools.e2e.checks import Check, report
from tools.e2e.cluster import Cluster, unwind_on_sigterm
from tools.e2e.cluster_spec import CPU_SERVE_ARGS, ClusterSpec
from tools.e2e.scenarios import prompt_ids

MAX_TOKENS = 6
# (prompt length, routed_experts_prompt_start): rows from 0, and from inside block 1.
PROMPTS = ((45, 0), (70, 33))
GENERATE = "/inference/v1/generate"
# The tiny tokenizer is word-level with no chat template: one word per message line.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    body: Callable[[list[int], int, int], dict[str, Any]]  # (prompt, start, n) -> body


def _sampling(start: int, n: int) -> dict[str, Any]:
    """Greedy for one choice; vLLM refuses n > 1 with greedy sampling, so several
    choices sample with a fixed seed (the reference then draws the same tokens)."""
    greedy = {"temperature": 0} if n == 1 else {"temperature": 1.0, "seed": 7}
    return {"max_tokens": MAX_TOKENS, "n": n, **greedy, "routed_experts_prompt_start": start}


def _completions(prompt: list[int], start: int, n: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "return_token_ids": True,
            **_sampling(start, n)}


def _chat(prompt: list[int], start: int, n: int) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user",
                                           "content": " ".join(map(word, prompt))}],
            "return_token_ids": True, **_sampling(start, n)}


def _generate(prompt: list[int], start: int, n: int) -> dict[str, Any]:
    return {"model": "tiny", "token_ids": prompt, "sampling_params": _sampling(start, n)}


ENDPOINTS = (Endpoint("completions", "/v1/completions", _completions),
             Endpoint("chat", "/v1/chat/completions", _chat),
             Endpoint("generate", GENERATE, _generate))


def _rows_check(what: str, rows: np.ndarray | None, want: np.ndarray | None) -> Check:
    if want is None:
        return Check(what, False, "the reference has no rows")
    ok = rows is not None and rows.shape == want.shape and np.array_equal(rows, want)
    if rows is None:
        detail = "no rows"
    elif rows.shape != want.shape:
        detail = f"shape {rows.shape}, reference {want.shape}"
    else:
        detail = f"{int((rows != want).any(axis=(1, 2)).sum())} of {len(want)} rows differ"
    return Check(what, ok, detail)


def check_non_streamed(url: str, endpoint: Endpoint, name: str, body: dict[str, Any],
                       reference: dict[str, Any], start: int) -> list[Check]:
    code, answer = post_json(url, endpoint.path, body)
    if code != 200:
        return [Check(f"{name}: answered", False, f"HTTP {code}: {str(answer)[:300]}")]
    choice, want = answer["choices"][0], reference["choices"][0]
    rows_what = f"{name}: rows equal the reference's"
    try:
        rows_check = _rows_check(rows_what, choice_rows(choice, response=answer),
                                 choice_rows(want, response=reference))
    except RoutedExpertsError as exc:
        rows_check = Check(rows_what, False, f"rows refused by the client decoder: {exc}")
    return [
        Check(f"{name}: tokens equal the reference's",
              choice.get("token_ids") == want["token_ids"],
              f"{choice.get('token_ids')} vs {want['token_ids']}"),
        Check(f"{name}: routed_experts_start = {start}",
              choice.get("routed_experts_start") == start,
              f"{choice.get('routed_experts_start')}"),
        rows_check,
    ]


def check_streamed(url: str, endpoint: Endpoint, name: str, body: dict[str, Any],
                   reference: dict[str, Any], start: int, n: int) -> list[Check]:
    try:
        chunks = post_stream(url, endpoint.path, body)
    except OSError as exc:
        return [Check(f"{name}: answered", False, repr(exc))]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return [Check(f"{name}: no error event", False, str(errors[0])[:300])]
    try:
        got = final_chunk_rows(chunks)
    except AssertionError as exc:
        return [Check(f"{name}: rows on the final chunk only", False, str(exc))]
    except RoutedExpertsError as exc:
        return [Check(f"{name}: final chunks' rows decode", False, str(exc))]
    checks = [Check(f"{name}: {n} final chunks", sorted(got) == list(range(n)),
                    f"final chunks for choices {sorted(got)}")]
    wants = {c["index"]: c for c in reference["choices"]}
    for index in range(n):
        want = wants[index]
        tokens = [t for c in chunks for choice in c.get("choices", [])
                  if choice["index"] == index for t in (choice.get("token_ids") or [])]
        finals = [choice for c in chunks for choice in c.get("choices", [])
                  if choice["index"] == index and choice.get("finish_reason")]
        starts = [f.get("routed_experts_start") for f in finals]
        checks += [
            Check(f"{name}, choice {index}: tokens equal the reference's",
                  tokens == want["token_ids"], f"{tokens} vs {want['token_ids']}"),
            Check(f"{name}, choice {index}: routed_experts_start = {start}",
                  starts == [start], f"{starts}"),
            _rows_check(f"{name}, choice {index}: rows equal the reference's",
                        got.get(index), choice_rows(want)),
        ]
    return checks


def check_endpoint(url: str, reference_url: str, endpoint: Endpoint, length: int,
                   start: int, front: str) -> list[Check]:
    """The non-streamed answer (one choice) and the streamed one (n = 2: a group
    whose children share one hand-off), each against the reference's non-streamed
    answer to the same body."""
    prompt = prompt_ids(31, length, length)
    name = f"{front}: {endpoint.name} P={length}, rows from {start}"
    checks: list[Check] = []
    for n, stream in ((1, False), (2, True)):
        body = endpoint.body(prompt, start, n)
        code, reference = post_json(reference_url, endpoint.path, body)
        if code != 200:
            checks.append(Check(f"{name}, n={n}: reference answered", False,
                                str(reference)[:300]))
        elif stream:
            checks += check_streamed(url, endpoint, f"{name}, streamed",
                                     body | {"stream": True}, reference, start, n)
        else:
            checks += check_non_streamed(url, endpoint, name, body, reference, start)
    return checks


def run(workdir: Path, mode: str, fronts: tuple[str, ...], transfer: bool,
        fault: str | None, prompts: tuple[tuple[int, int], ...] = PROMPTS) -> list[Check]:
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    template = workdir / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    spec = ClusterSpec(model, routed_experts_transfer=mode == ROWS_OVER_NIXL and transfer,
                       router=fronts[0],
                       fault=fault, serve_args=(*CPU_SERVE_ARGS, "--enable-scale-out",
                                                "--chat-template", str(template)))
    checks: list[Check] = []
    with Cluster(spec, workdir / "logs") as cluster:
        urls = {fronts[0]: cluster.url}
        extra = []
        for front in fronts[1:]:
            port = free_port()
            extra.append(cluster.start_front_end(front, port, f"front-{front}"))
            urls[front] = f"http://127.0.0.1:{port}"
        try:
            for front, url in urls.items():
                for endpoint in ENDPOINTS:
                    for length, start in prompts:
                        checks += check_endpoint(url, cluster.servers["reference"].url,
                                                 endpoint, length, start, front)
        finally:
            for process in extra:
                stop_process_group(process)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e.pd_endpoints",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=(PROXY_MERGE, ROWS_OVER_NIXL), default=PROXY_MERGE,
                        help=f"{PROXY_MERGE}: the P/D proxy merges prefill's and decode's "
                        f"rows; {ROWS_OVER_NIXL}: rows travel with the KV over NIXL "
                        "(default: %(default)s)")
    deprecated_values(parser, "--mode", {"merge": PROXY_MERGE, "rows": ROWS_OVER_NIXL})
    parser.add_argument("--router", choices=("vllm-router", "pdproxy"),
                        help=f"the one front end to check (default: pdproxy with --mode "
                        f"{PROXY_MERGE}; with --mode {ROWS_OVER_NIXL} both, vllm-router and "
                        f"pdproxy); {PROXY_MERGE} needs pdproxy")
    parser.add_argument("--fault",
                        choices=fault_registry.choices(fault_registry.PD_ENDPOINTS),
                        help="negative control: decode returns its rows shifted by one "
                        "position; the run must exit 1")
    parser.add_argument("--no-routed-experts-transfer", action="store_true",
                        help=f"negative control for --mode {ROWS_OVER_NIXL}: the "
                        "rows-transfer switch off on both roles; the run must exit 1")
    deprecated_alias(parser, "--no-transfer", "--no-routed-experts-transfer")
    parser.add_argument("--reduced", action="store_true",
                        help="rows from inside block 1 only (the prompt whose rows span "
                        "prefill's transfer and decode's forward; make test's run)")
    parser.add_argument("--workdir", type=Path, help="model and server logs (default: temp)")
    args = parser.parse_args(argv)
    if args.router:
        fronts: tuple[str, ...] = (args.router,)
    else:
        fronts = ("pdproxy",) if args.mode == PROXY_MERGE else ("vllm-router", "pdproxy")
    if args.mode == PROXY_MERGE and fronts != ("pdproxy",):
        parser.error(f"--mode {PROXY_MERGE} needs --router pdproxy: only the proxy merges "
                     "the two halves of the rows")
    if args.no_routed_experts_transfer and args.mode != ROWS_OVER_NIXL:
        parser.error("--no-routed-experts-transfer is the negative control of --mode "
                     f"{ROWS_OVER_NIXL}")
    unwind_on_sigterm()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pd-endpoints-"))
    prompts = PROMPTS[1:] if args.reduced else PROMPTS
    shown = ", ".join(f"P={length} rows from {start}" for length, start in prompts)
    switch_off = " (switch off)" if args.no_routed_experts_transfer else ""
    print(f"pd-endpoints: mode {args.mode}{switch_off}, "
          f"front: {', '.join(fronts)}, fault: {args.fault or 'none'}, prompts: {shown}, "
          f"logs under {workdir}", flush=True)
    checks = run(workdir, args.mode, fronts, not args.no_routed_experts_transfer, args.fault,
                 prompts)
    return report("pd-endpoints", checks)


if __name__ == "__main__":
    sys.exit(main())
