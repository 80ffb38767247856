"""Prefill lost between the hand-off and decode's read, with rows that travel with the KV.

    python -m tools.e2e.prefill_lost --policy recompute|fail [--workdir DIR]

A P/D pair of the installed fork (switch on both roles, chains from `vllm
kv-transfer-config --routed-experts-transfer`, the given `kv_load_failure_policy` on
both) and a colocated reference, on the harness's tiny MoE. The harness is the router
here, so it can act between the two hops, with the request bodies `vllm-r3-pdproxy`
sends (`prefill_body`, `decode_body`):

1. a warm-up request through the proxy, equal to the reference (the NIXL handshake is
   then cached, so what fails below is the read, not the handshake);
2. the hand-off: prefill computes the prompt and returns `kv_transfer_params`;
3. prefill's whole process group is killed (SIGKILL): its NIXL agent, the KV blocks
   and the rows slots decode is about to read are gone;
4. the decode request with those `kv_transfer_params`, rows from 0.

Expected, per policy:
- recompute: decode recomputes the prompt itself; its response equals the reference
  (tokens and every row from 0), and its counters show the failed read and a prompt
  it computed itself (all of it: the prompt is fresh, so nothing comes from decode's
  prefix cache; a hand-off that lands counts 0 there);
- fail: decode answers with an error (not a completion) that names the KV load failure
  and the policy, and counts the failed read.
Either way decode keeps serving: a request sent to decode alone afterwards equals the
reference. Exit 0 only when all of that holds; the last line is the summary. With
--keep-prefill (the negative control) nothing is killed, so the failed-read checks
must fail and the run exit 1.

The kill lands after prefill answered and before decode posts its READs; a kill
*during* a READ of a few KiB cannot be timed from outside on this host.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_r3_pdproxy.server import decode_body, prefill_body

from tools.testbed.metrics import read_total
from tools.testbed.tiny_moe import build
from tools.e2e.checks import Check, report
from tools.e2e.cluster import Cluster, unwind_on_sigterm
from tools.e2e.cluster_spec import ClusterSpec
from tools.e2e.compare import compare, post
from tools.e2e.pd_pair import (
    KV_LOAD_FAILED_HINT,
    LOCAL_COMPUTE,
    STATS_WAIT_SECONDS,
    kill_server,
)
from tools.e2e.scenarios import prompt_ids

PROMPT_LEN = 70  # two full 32-token blocks and a partial third: the READ moves 2 blocks
MAX_TOKENS = 4
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
# The cause NixlConnector gives when NIXL itself failed the load (a prefill that is
# gone): vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py.
PREFILL_LOST_CAUSE = ("could not be loaded: its NIXL transfer from the prefill instance "
                      "failed")


def _body(ids: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1,
            "routed_experts_prompt_start": 0}


def run(policy: str, workdir: Path, kill: bool = True) -> list[Check]:
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    cluster = Cluster(ClusterSpec(model, routed_experts_transfer=True,
                                  kv_load_failure_policy=policy),
                      workdir / f"logs-{policy}")
    checks: list[Check] = []
    try:
        cluster.start()
        reference = cluster.servers["reference"].url
        warm = _body(prompt_ids(61, 0, PROMPT_LEN))
        outcome = compare(post(cluster.proxy_url, warm), post(reference, warm))
        checks.append(Check("warm-up through the proxy equals colocated",
                            outcome.problem is None, outcome.problem or ""))

        body = _body(prompt_ids(61, 1, PROMPT_LEN))
        handoff = post(cluster.servers["prefill"].url, prefill_body(body))
        params = handoff.get("kv_transfer_params")
        checks.append(Check("prefill handed off", bool(params and params.get("remote_block_ids")),
                            str(handoff)[:300]))
        if kill:
            kill_server(cluster, "prefill")
        decode = cluster.servers["decode"].url
        before = {name: read_total(decode, name) for name in (FAILED_TRANSFERS, LOCAL_COMPUTE)}
        answer = post(decode, decode_body(body, params or {}), timeout=300.0)
        want = post(reference, body)
        time.sleep(STATS_WAIT_SECONDS)  # counters reach /metrics with the stats interval
        failed = read_total(decode, FAILED_TRANSFERS) - before[FAILED_TRANSFERS]
        computed = read_total(decode, LOCAL_COMPUTE) - before[LOCAL_COMPUTE]
        checks.append(Check("decode counted the failed NIXL read", failed > 0,
                            f"{FAILED_TRANSFERS} +{failed:g}"))
        if policy == "recompute":
            outcome = compare(answer, want, label="decode")
            checks.append(Check("decode recomputed: tokens and rows equal colocated",
                                outcome.problem is None, outcome.problem or ""))
            # A fresh prompt recomputed in full; a hand-off that lands counts 0.
            checks.append(Check(f"decode computed the prompt itself ({computed:g} of "
                                f"{PROMPT_LEN} tokens)", computed == PROMPT_LEN,
                                f"{LOCAL_COMPUTE} +{computed:g}"))
        else:
            checks.append(Check("decode answered with an error, not a completion",
                                "error" in answer, str(answer)[:300]))
            error = str(answer.get("error"))
            checks.append(Check("the error names the failed NIXL transfer and the policy",
                                KV_LOAD_FAILED_HINT in error and PREFILL_LOST_CAUSE in error,
                                str(answer)[:300]))

        after = _body(prompt_ids(61, 2, PROMPT_LEN))
        outcome = compare(post(cluster.servers["decode"].url, after), post(reference, after),
                          label="decode")
        checks.append(Check("decode keeps serving: a later request equals colocated",
                            outcome.problem is None, outcome.problem or ""))
    finally:
        cluster.stop()
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e.prefill_lost",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", choices=("recompute", "fail"), required=True,
                        help="kv_load_failure_policy on both roles")
    parser.add_argument("--workdir", type=Path, help="model and server logs (default: temp)")
    parser.add_argument("--keep-prefill", action="store_true",
                        help="negative control: do not kill prefill. The read then "
                        "succeeds, so the checks that it failed (and, with recompute, "
                        "that decode computed the prompt itself) must fail, and the run "
                        "must exit 1")
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="prefill-lost-"))
    control = ", negative control: prefill kept alive" if args.keep_prefill else ""
    print(f"prefill-lost: policy {args.policy}{control}, logs under {workdir}", flush=True)
    return report(f"prefill-lost: policy {args.policy}",
                  run(args.policy, workdir, kill=not args.keep_prefill))


if __name__ == "__main__":
    sys.exit(main())
