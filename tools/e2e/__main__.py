"""Equivalence harness: routed experts under NIXL P/D must equal colocated serving.

    python -m tools.e2e [--reduced] [--fault NAME] [--only SCENARIO ...] [--workdir DIR]
                     [--pd-chain FLAGS] [--model PATH --serve-args ARGS --kv-buffer-device D]

Starts, on CPU with the installed fork, a prefill and a decode server joined by
NixlConnector, the P/D proxy and a colocated reference server, all on the same
tiny random-weight Qwen3-MoE (built locally), sends each scenario's greedy
requests through the proxy and to the reference, and prints one row per
scenario. KV-offload scenarios run multi-turn conversations against a server
with vLLM's OffloadingConnector and a small KV cache (colocated, or on the
prefill side of P/D), beside a twin with routed experts off whose loads nothing
limits. Exits 0 only when every scenario has zero mismatches. With --fault, the
server under test carries a planted fault; that run must report mismatches and
exit non-zero (the negative control). The last line is the summary.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from vllm.distributed.kv_transfer.role_chains import (
    Deployment,
    RoleConfigError,
    validate_deployment,
)
from vllm.entrypoints.cli.kv_transfer_config import (
    KVTransferConfigSubcommand,
    deployment_from_args,
)

from tools.testbed.aliases import deprecated_alias
from tools.e2e import fault_registry
from tools.e2e.cluster import unwind_on_sigterm
from tools.e2e.cluster_spec import CPU_SERVE_ARGS, ClusterSpec
from tools.e2e.harness import (
    MIN_LOAD_RATIO,
    HarnessOptions,
    build_models,
    groups_of,
    mode_label,
    pd_only,
    print_report,
    run_groups,
    select_scenarios,
    shape_label,
)
from tools.e2e.scenarios import BLOCK_SIZE


def pd_deployment(flags: str | None) -> Deployment | None:
    """The deployment `vllm kv-transfer-config --role decode FLAGS` describes."""
    if flags is None:
        return None
    parser = argparse.ArgumentParser(prog="--pd-chain")
    KVTransferConfigSubcommand().subparser_init(parser.add_subparsers())
    parsed = parser.parse_args(["kv-transfer-config", "--role", "decode", *shlex.split(flags)])
    deployment = deployment_from_args(parsed)
    try:  # refuse a bad deployment here, not when its servers start
        validate_deployment(deployment)
    except RoleConfigError as exc:
        parser.error(str(exc))
    return deployment


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="the short version run by make test")
    parser.add_argument("--fault",
                        choices=fault_registry.choices(fault_registry.HARNESS),
                        help="plant a fault on the decode server (tools/e2e/fault_registry.py)")
    parser.add_argument("--workdir", type=Path, help="models and server logs (default: temp dir)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these scenario names (long-context, for GPU runs, "
                             "runs only when named)")
    parser.add_argument(
        "--pd-chain", metavar="FLAGS",
        help="run the P/D scenarios (groups base and preempt) with the chains "
             "`vllm kv-transfer-config "
             "--role prefill|decode FLAGS` prints, e.g. \"--decode-offload off "
             "--hisparse-host-pool-gib 64\" (default: NIXL alone)")
    parser.add_argument(
        "--model", type=Path,
        help="serve this model instead of the tiny random ones (runs only the scenarios "
             "that use the base model); a GPU run also passes --serve-args and "
             "--kv-buffer-device")
    parser.add_argument(
        "--serve-args", default=" ".join(CPU_SERVE_ARGS), metavar="ARGS",
        help="`vllm serve` arguments besides routed experts and the chain (default: "
             "%(default)s)")
    parser.add_argument("--kv-buffer-device", default="cpu",
                        help="NixlConnector kv_buffer_device (default: cpu)")
    parser.add_argument("--graphs", action="store_true",
                        help="serve without --enforce-eager (GPU runs: CUDA graphs as the "
                             "config resolves them)")
    parser.add_argument(
        "--routed-experts-transfer", action="store_true",
        help="the rows-transfer switch (kv_transfer_config.enable_routed_experts_transfer, "
             "the builder's --routed-experts-transfer): on both P/D roles, rows "
             "travel with the KV over NIXL and decode returns all of them; on a native "
             "offload, each chunk carries its rows and the subject must load at least "
             f"{MIN_LOAD_RATIO} of what its twin loads (default scenarios: P/D without "
             "offload, and the colocated offload)")
    deprecated_alias(parser, "--rows-transfer", "--routed-experts-transfer")
    parser.add_argument(
        "--routed-experts-transfer-only-on", choices=("prefill", "decode"),
        help="a one-sided switch: enable_routed_experts_transfer on this P/D role only. "
             "Decode's NIXL handshake must refuse the peer with a message naming both "
             "sides' formats, so every request fails and the run exits non-zero (a "
             "negative control; the P/D scenarios, like --routed-experts-transfer)")
    deprecated_alias(parser, "--rows-transfer-only-on", "--routed-experts-transfer-only-on")
    parser.add_argument(
        "--kv-load-failure-policy", choices=("recompute", "fail"),
        help="kv_transfer_config.kv_load_failure_policy on both P/D roles (default: the "
             "builder's)")
    parser.add_argument(
        "--router", choices=("pdproxy", "vllm-router"), default="pdproxy",
        help="what sits in front of P/D: our merging proxy (default) or the vllm-router "
             "binary in --vllm-pd-disaggregation mode (decode's response only; needs "
             "--routed-experts-transfer for complete rows)")
    shape = parser.add_argument_group(
        "deployment shape of the P/D roles (docs/deployment-shapes.md); the colocated "
        "reference stays TP = 1, synchronous, so in float32 every shape must equal it")
    shape.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                       help="prefill's --tensor-parallel-size (default: 1)")
    shape.add_argument("--decode-tp", type=int, default=1, metavar="N",
                       help="decode's --tensor-parallel-size (default: 1)")
    shape.add_argument("--async-scheduling", action="store_true",
                       help="--async-scheduling on every P/D role")
    shape.add_argument(
        "--rows-oracle-margin", type=float, metavar="GAP",
        help="check rows against transformers' float32 router top-k on each response's "
             "own tokens instead of the reference's rows, allowing a different expert "
             "where the k-th and (k + 1)-th router logits are closer than GAP (bf16 "
             "serving with another TP than the reference; docs/deployment-shapes.md "
             "gives the measured margin); tokens are compared with the reference and "
             "counted, not required equal")
    shape.add_argument(
        "--reference-first", action=argparse.BooleanOptionalAction, default=None,
        help="serve the reference alone first, record its answers and stop it before "
             "the deployment starts, so that it never competes with the deployment for "
             "cores (default: on when a role's TP is above 1)")
    args = parser.parse_args(argv)
    if args.rows_oracle_margin is not None and args.rows_oracle_margin < 0:
        parser.error(f"--rows-oracle-margin {args.rows_oracle_margin}: a logit gap is 0 "
                     "or more")
    for flag, value in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if value < 1:
            parser.error(f"{flag} {value}: a tensor-parallel size is 1 or more")
    if (args.fault in fault_registry.in_mode(fault_registry.ROWS_TRANSFER)
            and not args.routed_experts_transfer):
        parser.error(f"--fault {args.fault} plants a fault in the rows transfer: add "
                     "--routed-experts-transfer")
    if args.routed_experts_transfer and args.routed_experts_transfer_only_on:
        parser.error("--routed-experts-transfer turns the switch on on both roles; "
                     "--routed-experts-transfer-only-on on one: pass one of them")
    return args


def reference_first(args: argparse.Namespace) -> bool:
    """--reference-first as given, else on for shapes with a TP > 1 role: on 2 cores
    a third engine beside them starved a rank (docs/deployment-shapes.md)."""
    if args.reference_first is not None:
        return bool(args.reference_first)
    return args.prefill_tp > 1 or args.decode_tp > 1


def options_from(args: argparse.Namespace, model: Path) -> HarnessOptions:
    """The settings every group's deployment shares (`model`: the base group's)."""
    spec = ClusterSpec(model, fault=args.fault, serve_args=tuple(shlex.split(args.serve_args)),
                       kv_buffer_device=args.kv_buffer_device, enforce_eager=not args.graphs,
                       routed_experts_transfer=args.routed_experts_transfer,
                       routed_experts_transfer_only_on=args.routed_experts_transfer_only_on,
                       router=args.router,
                       kv_load_failure_policy=args.kv_load_failure_policy,
                       prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                       async_scheduling=args.async_scheduling,
                       rows_oracle_margin=args.rows_oracle_margin,
                       reference_first=reference_first(args))
    return HarnessOptions(spec, pd_chain=pd_deployment(args.pd_chain))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unwind_on_sigterm()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-fork-e2e-"))
    scenarios = select_scenarios(args.reduced, args.only, args.model is not None,
                                 args.routed_experts_transfer,
                                 args.routed_experts_transfer_only_on is not None)
    shaped = args.prefill_tp > 1 or args.decode_tp > 1 or args.async_scheduling
    if shaped:
        try:
            scenarios = pd_only(scenarios, named=args.only is not None)
        except ValueError as exc:
            print(f"python -m tools.e2e: error: {exc}", file=sys.stderr)
            return 2
    groups = groups_of(scenarios)
    models = build_models(workdir, args.model, groups)
    options = options_from(args, models["base"])
    mode = mode_label(args.routed_experts_transfer, args.routed_experts_transfer_only_on)
    print(f"e2e: {len(scenarios)} scenarios in {len(groups)} deployment(s), block size "
          f"{BLOCK_SIZE}, P/D: {mode}, front: {args.router}, fault: {args.fault or 'none'}, "
          f"shape: {shape_label(args.prefill_tp, args.decode_tp, args.async_scheduling)}, "
          f"reference: {'served first' if options.spec.reference_first else 'beside'}, "
          f"logs under {workdir}", flush=True)
    start = time.monotonic()
    results = run_groups(scenarios, models, options, workdir)
    return print_report(results, time.monotonic() - start, args.fault)


if __name__ == "__main__":
    sys.exit(main())
