"""`make demo`: router replay under NIXL prefill/decode, on CPU, with the fork.

Run as `python -m tools.demo` from the repository root (the Makefile does).
Builds a random-weight Qwen3-MoE locally (no hub), starts a prefill and a decode
`vllm serve` joined by NixlConnector (chains from `vllm kv-transfer-config`) and a
colocated reference server (all with --enable-return-routed-experts, through the
CPU opt-in VLLM_CPU_TRITON_INTERPRET=1), sends one greedy completion through the
front end, shows what prefill and decode each return, compares the front end's rows
with the colocated server's, and stops everything.

Two modes (`--mode`), the two ways the fork returns complete rows under P/D
(docs/glossary.md):
- `rows-over-nixl` (the default, the recommended path): both roles set
  enable_routed_experts_transfer, the rows travel with the KV over NIXL, and the
  stock `vllm-router` (0.1.17) returns decode's response as is.
- `proxy-merge`: no switch; prefill returns the prompt's rows, decode the rest, and the
  fork's P/D proxy (`vllm-r3-pdproxy`) merges them by position.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from vllm.entrypoints.routed_experts import RoutedExpertsError
from vllm_r3_pdproxy.endpoints import PREFILL_KV_PARAMS

from tools.testbed.cpu_server import choice_rows
from tools.testbed.tiny_moe import build
from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import ClusterSpec
from tools.e2e.compare import post


@dataclass(frozen=True)
class DemoMode:
    """How the P/D pair returns complete rows, and what sits in front of it."""

    routed_experts_transfer: bool  # enable_routed_experts_transfer on both roles
    router: str  # the front end: "vllm-router" or "pdproxy"
    summary: str


MODES = {
    "rows-over-nixl": DemoMode(True, "vllm-router", "rows travel with the KV over NIXL; "
                             "vllm-router returns decode's response as is"),
    "proxy-merge": DemoMode(False, "pdproxy", "prefill returns the prompt's rows, decode the "
                      "rest; the fork's proxy merges them by position"),
}


def show(label: str, choice: dict) -> np.ndarray | None:
    """Print the choice's rows, decoded by the fork's client decoder; return them
    (None when there are none or the decoder refuses them)."""
    try:
        rows = choice_rows(choice)
    except RoutedExpertsError as exc:
        print(f"  {label:<11} rows refused: {exc}")
        return None
    start = choice.get("routed_experts_start")
    if rows is None:
        print(f"  {label:<11} no rows")
        return None
    print(f"  {label:<11} positions [{start}, {start + len(rows)}), shape {rows.shape}, "
          f"dtype {rows.dtype}; first row {rows[0].tolist()}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="model and server logs (default: a temp dir)")
    parser.add_argument("--prompt-len", type=int, default=21)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--mode", choices=tuple(MODES), default="rows-over-nixl",
                        help="rows-over-nixl: rows travel with the KV over NIXL behind "
                             "vllm-router (default); proxy-merge: the fork's proxy merges "
                             "prefill's and decode's rows")
    args = parser.parse_args()
    mode = MODES[args.mode]

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-fork-demo-"))
    print(f"vllm {importlib.metadata.version('vllm')} (the fork, CPU base)")
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    print(f"mode {args.mode}: {mode.summary}")
    print(f"starting prefill and decode (NixlConnector chains from the builder behind "
          f"`vllm kv-transfer-config`), {mode.router} and a colocated reference ...")
    spec = ClusterSpec(model, routed_experts_transfer=mode.routed_experts_transfer,
                       router=mode.router)
    with Cluster(spec, logs=workdir / "logs") as cluster:
        servers = cluster.servers
        prompt = list(range(10, 10 + args.prompt_len))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0, "return_token_ids": True}
        print(f"servers: prefill {servers['prefill'].url}, decode {servers['decode'].url}, "
              f"{mode.router} {cluster.proxy_url}, reference {servers['reference'].url} "
              f"(logs: {cluster.logs})")
        print(f"request: {args.prompt_len} prompt tokens, max_tokens {args.max_tokens}, greedy")

        # A hand-off as the front end sends it, to show what each instance returns.
        prefill = post(servers["prefill"].url, body | {
            "max_tokens": 1, "kv_transfer_params": dict(PREFILL_KV_PARAMS)})
        decode = post(servers["decode"].url, body | {
            "kv_transfer_params": prefill["kv_transfer_params"]})
        front = post(cluster.proxy_url, body)
        reference = post(servers["reference"].url, body)
    print("all servers stopped")

    for name, response in (("prefill", prefill), ("decode", decode), (mode.router, front),
                           ("reference", reference)):
        if "error" in response:
            print(f"{name} failed: {response['error']}")
            return 1
    print("routed experts (rows: positions x layers x top_k):")
    if show("prefill", prefill["choices"][0]) is None and mode.routed_experts_transfer:
        print("             (a hand-off's response carries none: they travel with the KV)")
    show("decode", decode["choices"][0])
    a, b = front["choices"][0], reference["choices"][0]
    rows_a, rows_b = show(mode.router, a), show("colocated", b)
    same_rows = (rows_a is not None and rows_b is not None
                 and a["routed_experts_start"] == b["routed_experts_start"]
                 and rows_a.shape == rows_b.shape and bool((rows_a == rows_b).all()))
    print(f"completion tokens: P/D {a['token_ids']}, colocated {b['token_ids']}")
    print(f"P/D rows ({args.mode}) equal colocated rows: {same_rows}; "
          f"tokens equal: {a['token_ids'] == b['token_ids']}")
    return 0 if same_rows and a["token_ids"] == b["token_ids"] else 1


if __name__ == "__main__":
    sys.exit(main())
