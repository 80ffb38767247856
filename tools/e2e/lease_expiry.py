"""Decode reading KV blocks after prefill's NIXL lease ran out and the blocks were reused.

    python -m tools.e2e.lease_expiry [--routed-experts-transfer] [--store]
                                     [--reuse plain|handoff]
                                     [--policy recompute|fail] [--fault no-lease-check]
                                     [--lease SECONDS] [--workdir DIR]

A reproduction of the lease-expiry bug in docs/r3-pd.md ("NIXL lease expiry"), on a
P/D pair of the installed fork and a colocated reference (the harness's tiny MoE,
`kv_load_failure_policy` from `--policy`, default recompute). Prefill gets a KV cache of 7 usable 32-token
blocks and a short lease (default 5 s). The harness is the router, so it can hold the
decode request back:

1. a warm-up request through the proxy (the NIXL handshake is then cached);
2. hand-off A (70 tokens: 3 blocks) to prefill, which keeps A's blocks for decode;
3. prompt B (200 tokens: 7 blocks) to prefill: it cannot be placed while A's blocks
   are held, so it waits until A's lease runs out, then takes A's blocks. B is a plain
   request (`--reuse plain`, as a prefill instance that also serves ordinary requests
   sees) or another hand-off (`--reuse handoff`);
4. only then A's decode request, with A's `kv_transfer_params`: decode reads A's
   block ids, which now hold B's KV.

Prints what prefill logged (the expired lease), what decode did (its lease generation
check, counters) and whether its answer equals colocated serving. Exit 0 only when
prefill released A's lease, decode's generation check refused the read, and decode
either recomputed A (all of its prompt tokens, an answer equal to the reference) or,
with `--policy fail`, failed it with an error that names the KV load failure and the
policy. Exit 1 otherwise, in particular when
decode completed the request from the reused KV (the bug: stock vLLM 0.31.0 does this
here, and so does `--fault no-lease-check`, which plants that behaviour on decode,
the negative control). With `--routed-experts-transfer` (the rows-transfer switch) the
rows slots are checked too (with `--reuse handoff` B's hand-off rewrites them); the
generation check comes first.

With `--store` both roles also have the Mooncake store (prefill saves A's prompt
blocks there), so decode's recompute can load A's prefix from the store instead of
computing it. With rows that travel with the KV the store keeps each chunk's rows
beside it, and decode returns A's rows from 0: it may load only blocks whose rows
objects came with them and pass their checks (A's two full blocks: it computes the
last 6 tokens itself), and its rows must equal colocated; without the switch, decode
emits only from its own first forward and may load them. `--fault
unbounded-pd-decode-loads` plants the old behaviour (the load does not ask for rows,
and decode returns rows it never checked): the run must exit 1. When the store's own load fails as well (decode counts two failed loads),
the reload was not exercised and the run exits 3 (inconclusive).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_r3_pdproxy.server import decode_body, prefill_body

from tools.testbed.aliases import deprecated_alias
from tools.testbed.metrics import read_total
from tools.testbed.tiny_moe import build
from tools.e2e import fault_registry
from tools.e2e.cluster import Cluster, unwind_on_sigterm
from tools.e2e.cluster_spec import ClusterSpec, mooncake_pd
from tools.e2e.compare import compare, post
from tools.e2e.pd_pair import (
    KV_LOAD_FAILED_HINT,
    LOCAL_COMPUTE,
    STATS_WAIT_SECONDS,
)
from tools.e2e.scenarios import prompt_ids
from vllm.distributed.kv_transfer.role_chains import Deployment

PREFILL_BLOCKS = 8  # --num-gpu-blocks-override: 7 usable 32-token blocks
A_LEN, B_LEN = 70, 200  # 3 blocks, 7 blocks: B fits only once A's blocks are freed
EXPIRED = "Releasing expired KV blocks"
FAILED_LOADS = "vllm:kv_load_failed_requests_total"  # requests, by policy outcome
LEASE_CAUSE = "the prefill instance released its KV blocks on lease expiry"
INCONCLUSIVE = 3  # exit code: the store's own load failed, so the reload was not shown
REFUSED = "released the blocks on lease expiry"  # decode's generation check


def _body(ids: list[int], max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
            "routed_experts_prompt_start": 0}


def run(workdir: Path, routed_experts_transfer: bool, reuse: str, lease: int,
        policy: str = "recompute", fault: str | None = None, store: bool = False) -> int:
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    deployment = mooncake_pd() if store else Deployment(pd=True)
    spec = ClusterSpec(model, deployment=deployment,
                       routed_experts_transfer=routed_experts_transfer,
                       kv_load_failure_policy=policy,
                       kv_lease_seconds=lease, offload_num_blocks=PREFILL_BLOCKS,
                       fault=fault)
    cluster = Cluster(spec, workdir / "logs")
    try:
        cluster.start()
        prefill, decode = cluster.servers["prefill"].url, cluster.servers["decode"].url
        reference = cluster.servers["reference"].url
        warm = _body(prompt_ids(71, 0, A_LEN))
        warm_outcome = compare(post(cluster.proxy_url, warm), post(reference, warm))
        print(f"lease-expiry: warm-up through the proxy: "
              f"{warm_outcome.problem or 'equal to colocated'}")

        a = _body(prompt_ids(71, 1, A_LEN))
        handoff = post(prefill, prefill_body(a))
        params = handoff["kv_transfer_params"]
        print(f"lease-expiry: hand-off A: prefill blocks {params['remote_block_ids']}")
        b = _body(prompt_ids(71, 2, B_LEN), max_tokens=1)
        started = time.monotonic()
        b_answer = post(prefill, prefill_body(b) if reuse == "handoff" else b)
        waited = time.monotonic() - started
        b_blocks = (b_answer.get("kv_transfer_params") or {}).get("remote_block_ids")
        print(f"lease-expiry: prompt B ({reuse}) served after {waited:.1f} s"
              + (f", prefill blocks {b_blocks}" if b_blocks else ""))
        expired = cluster.log_count("prefill", EXPIRED)
        print(f"lease-expiry: prefill logged '{EXPIRED}' {expired} time(s)")

        before = read_total(decode, LOCAL_COMPUTE)
        failed_before = read_total(decode, FAILED_LOADS)
        answer = post(decode, decode_body(a, params), timeout=300.0)
        time.sleep(STATS_WAIT_SECONDS)
        computed = read_total(decode, LOCAL_COMPUTE) - before
        failed_loads = read_total(decode, FAILED_LOADS) - failed_before
        checks = cluster.rows_check_failures()
        refused = cluster.log_count("decode", REFUSED)
        print(f"lease-expiry: decode computed {computed:g} of A's {A_LEN} prompt tokens "
              f"itself (a landed hand-off counts 0); generation checks failed: {refused}; "
              f"rows checks failed: {checks}")
        outcome = compare(answer, post(reference, a), label="decode")
        verdict = 1
        if "error" in answer:
            print(f"lease-expiry: decode failed A with an error: {answer['error'][:300]}")
            # Without the store the refused read is the only failed load: the
            # error names lease expiry as its cause.
            named = store or LEASE_CAUSE in answer["error"]
            verdict = 0 if policy == "fail" and KV_LOAD_FAILED_HINT in answer["error"] \
                and named else 1
        elif outcome.problem is None:
            print("lease-expiry: decode's answer for A equals colocated")
            # Decode computed A itself, or (store) loaded blocks that brought rows.
            reloaded = store and routed_experts_transfer
            verdict = 0 if policy == "recompute" and (computed >= A_LEN or reloaded) else 1
        else:
            print(f"lease-expiry: decode's answer for A differs from colocated (reused KV, "
                  f"or rows it never had): {outcome.problem}")
        if not refused:
            print("lease-expiry: decode's lease generation check refused nothing")
            verdict = 1
        if not expired:
            print("lease-expiry: prefill logged no expired lease, so the run proves nothing")
            verdict = 1
        if store and failed_loads > 1 and verdict == 0:
            # The refused read is one failed load; a second is the store's own get
            # (seen here: a TCP get that timed out after 30 s on a loaded machine).
            print(f"lease-expiry: decode counted {failed_loads:g} failed loads: the store's "
                  "own load failed too, so the reload was not exercised (inconclusive)")
            verdict = INCONCLUSIVE
    finally:
        cluster.stop()
    outcome = {0: f"decode refused the expired lease ({policy})",
               INCONCLUSIVE: "INCONCLUSIVE (see above)"}.get(verdict, "FAILED (see above)")
    mode = ("rows with the KV" if routed_experts_transfer else "switch off") + (
        ", Mooncake store" if store else "")
    print(f"lease-expiry: {mode}, B {reuse}, policy {policy}, lease {lease} s"
          + (f", fault {fault}" if fault else "") + f": {outcome}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e.lease_expiry",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routed-experts-transfer", action="store_true",
                        help="the rows-transfer switch (enable_routed_experts_transfer) on "
                        "both roles")
    deprecated_alias(parser, "--rows-transfer", "--routed-experts-transfer")
    parser.add_argument("--store", action="store_true",
                        help="the Mooncake store on both roles (prefill saves A's blocks "
                        "there; decode's recompute may load them)")
    parser.add_argument("--reuse", choices=("plain", "handoff"), default="plain",
                        help="what takes A's blocks on prefill (default: plain)")
    parser.add_argument("--policy", choices=("recompute", "fail"), default="recompute",
                        help="kv_load_failure_policy on decode (default: recompute)")
    parser.add_argument("--fault",
                        choices=fault_registry.choices(fault_registry.LEASE_EXPIRY),
                        help="plant decode's old behaviour (negative control: must exit 1): "
                        "no-lease-check trusts a read of released blocks; "
                        "unbounded-pd-decode-loads (with --routed-experts-transfer "
                        "--store) lets "
                        "the recompute load rowless blocks from the store")
    parser.add_argument("--lease", type=int, default=5,
                        help="NIXL kv_lease_duration on both roles, seconds (default: 5)")
    parser.add_argument("--workdir", type=Path, help="model and server logs (default: temp)")
    args = parser.parse_args(argv)
    unwind_on_sigterm()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lease-expiry-"))
    print(f"lease-expiry: logs under {workdir}", flush=True)
    return run(workdir, args.routed_experts_transfer, args.reuse, args.lease, args.policy,
               args.fault, args.store)


if __name__ == "__main__":
    sys.exit(main())
