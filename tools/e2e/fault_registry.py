"""The planted faults of the negative controls: one entry per fault, the one list.

A fault is planted by `tools/e2e/faults/sitecustomize.py` in a process started with
`E2E_FAULT=<name>` (a server of the harness, or a pytest run of
`tools.testbed.faulted_pytest`). That file runs inside the servers and imports
nothing of this repository, so it keeps its own table of what to patch; a unit test
(tests/tools/test_fault_registry.py) holds the two to the same names.

Everything else reads this module: the `--fault` choices of each entry point
(`choices`), `make e2e FAULT=<name>` (which of its runs plants the fault: `make_mode`
and `make_args`, read by tools/e2e/plan.py), and the table in docs/testing.md
(`markdown_table`, rendered by `python -m tools.fork docs`). Its command line answers
the same questions (`python -m tools.e2e.fault_registry mode|make-args|list`).

This module imports nothing beyond the standard library (and tools/testbed/aliases.py,
which imports only that): make runs it (through tools/e2e/plan.py) before anything
else is needed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from tools.testbed.aliases import deprecated_values

# The entry points that take `--fault NAME`, and pytest runs under a fault.
HARNESS = "tools.e2e"
PD_ENDPOINTS = "tools.e2e.pd_endpoints"
SOAK = "tools.e2e.soak"
LEASE_EXPIRY = "tools.e2e.lease_expiry"
FAULTED_PYTEST = "tools.testbed.faulted_pytest"
ENTRY_POINTS = (HARNESS, PD_ENDPOINTS, SOAK, LEASE_EXPIRY, FAULTED_PYTEST)

# Modes: which run of `make e2e` plants the fault, or that only pytest does. The two
# harness runs are named as docs/glossary.md names them: the proxy merge (the
# rows-transfer switch off), and rows transfer (the switch on: rows over NIXL and with
# the offload tiers' chunks, so not only rows over NIXL).
MERGE = "proxy-merge"  # python -m tools.e2e, rows merged by the proxy
ROWS_TRANSFER = "rows-transfer"  # python -m tools.e2e --routed-experts-transfer
# (make e2e-routed-experts-transfer)
LEASE = "lease-expiry"  # python -m tools.e2e.lease_expiry (make e2e-lease)
PYTEST_CONTROL = "pytest-control"  # a unit test file run again under the fault
MODES = (MERGE, ROWS_TRANSFER, LEASE, PYTEST_CONTROL)
# Old spellings of a mode that `list --mode` still takes (tools/testbed/aliases.py).
OLD_MODES = {"merge": MERGE}


@dataclass(frozen=True)
class Fault:
    """One planted fault.

    `mode`: the run it belongs to (`MODES`); a rows-transfer fault needs the
    harness's `--routed-experts-transfer`. `entry_points`: the modules whose `--fault` accepts
    it (`FAULTED_PYTEST` for pytest controls). `plants`: what it changes, one
    sentence. `control`: what must fail under it, and which test or make target
    shows that. `make_e2e`: whether `make e2e FAULT=<name>` runs it (in its mode);
    `make_args`: the harness flags make adds for it.
    """

    name: str
    mode: str
    entry_points: tuple[str, ...]
    plants: str
    control: str
    make_e2e: bool = True
    make_args: tuple[str, ...] = ()


RECOMPUTE = ("--kv-load-failure-policy", "recompute")

FAULTS: tuple[Fault, ...] = (
    Fault("no-floor", MERGE, (HARNESS,),
          "Decode loses its decode emit floor, so it asks for rows it never computed.",
          "The P/D scenarios report mismatches and exit 1 "
          "(tests/v1/kv_connector/test_pd_routed_experts_e2e.py)."),
    Fault("no-skip", MERGE, (HARNESS,),
          "The worker no longer skips the partially computed first block.",
          "The P/D scenarios report mismatches and exit 1."),
    Fault("shift-decode-rows", MERGE, (HARNESS, PD_ENDPOINTS, SOAK),
          "Every rows array the server returns is shifted by one position.",
          "The harness, every endpoint and the soak count mismatches and exit 1 "
          "(tests/v1/kv_connector/test_pd_endpoints_e2e.py, test_soak_e2e.py, "
          "test_pd_rows_transfer_e2e.py)."),
    Fault("no-clamp", MERGE, (HARNESS,),
          "KV-offload loads are no longer limited to the positions before the prompt "
          "start.",
          "The offload scenarios report BlockObjectStoreError and mismatches, exit 1 "
          "(tests/v1/kv_connector/test_offload_routed_experts_e2e.py)."),
    Fault("no-row-transfer", ROWS_TRANSFER, (HARNESS,),
          "Decode skips the rows READ beside the KV READ; its slots keep what they held.",
          "Every pulled block fails decode's rows check; the run exits 1."),
    Fault("corrupt-row-tag", ROWS_TRANSFER, (HARNESS,),
          "The first slot decode checks after each pull has a wrong token chain in its "
          "tag.",
          "Decode reports the failed check and recomputes (rows equal); the run exits 1.",
          make_args=RECOMPUTE),
    Fault("rows-not-imported", ROWS_TRANSFER, (HARNESS,),
          "Offload loads (native offload, Mooncake store) no longer hand their chunks' "
          "rows to the capture.",
          "The load is refused (fails closed); the run exits 1 "
          "(tests/v1/kv_connector/test_mooncake_store_restart_e2e.py)."),
    Fault("corrupt-rows", ROWS_TRANSFER, (HARNESS,),
          "The first offloaded chunk (or store rows object) each load checks has a wrong "
          "token chain in its tag.",
          "The chunk is reported and recomputed (rows equal); the run exits 1 "
          "(tests/v1/kv_connector/test_offload_rows_e2e.py, "
          "test_mooncake_store_rows_e2e.py).",
          make_args=RECOMPUTE),
    Fault("leak-floors", MERGE, (HARNESS, SOAK),
          "A finished request keeps its decode emit floor: rows stay right, state leaks.",
          "Only the leak check reports it (tests/v1/kv_connector/"
          "test_pd_routed_experts_e2e.py); the soak takes it with --mode proxy-merge "
          "only."),
    Fault("hold-finished-blocks", MERGE, (HARNESS,),
          "Finished requests' offload blocks wait for a store completion that never "
          "comes: the KV cache leaks.",
          "Only the abort scenarios' held-KV check reports it "
          "(tests/v1/kv_connector/test_abort_mid_store_e2e.py)."),
    Fault("no-lease-check", LEASE, (LEASE_EXPIRY,),
          "Decode no longer compares the lease generation words it read (stock 0.31.0).",
          "Decode answers from reused KV; the lease-expiry run exits 1 "
          "(`make e2e-lease FAULT=no-lease-check`)."),
    Fault("unbounded-pd-decode-loads", LEASE, (LEASE_EXPIRY,),
          "Every P/D decode request keeps the offload-limit exemption, even when its "
          "rows travel with the KV.",
          "lease_expiry --routed-experts-transfer --store exits 1 "
          "(tests/v1/kv_connector/test_rows_with_kv_store_reload_e2e.py).",
          make_e2e=False),
    Fault("uncapped-store-lookups", PYTEST_CONTROL, (FAULTED_PYTEST,),
          "The Mooncake store's lookups no longer end before chunks whose load failed.",
          "Every test of tests/v1/kv_connector/unit/test_mooncake_store_load_failure_"
          "retry.py fails (test_mooncake_store_load_failure_control.py, "
          "`make e2e-controls`).",
          make_e2e=False),
    Fault("reversed-role-chains", PYTEST_CONTROL, (FAULTED_PYTEST,),
          "The kv-transfer-config builder prints every chain in reverse (NIXL last).",
          "The golden and the examples of tests/distributed/kv_transfer/"
          "test_role_chains.py fail (test_role_chains_control.py, `make e2e-controls`).",
          make_e2e=False),
    Fault("unshared-handoff-loads", PYTEST_CONTROL, (FAULTED_PYTEST,),
          "NIXL names no hand-off a request loads, so each child of an n > 1 request "
          "pulls it itself.",
          "The read-once and notify-once checks of tests/v1/kv_connector/"
          "test_pd_group_sampling_e2e.py fail (test_pd_group_sampling_control.py, "
          "`make e2e-controls`).",
          make_e2e=False),
)

BY_NAME: dict[str, Fault] = {fault.name: fault for fault in FAULTS}


class UnknownFault(ValueError):
    """A name that is not in the registry, or not for the place that was asked."""


def fault(name: str) -> Fault:
    """The entry named `name`; UnknownFault (naming the known ones) otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnknownFault(f"unknown fault {name!r}; the registry "
                           f"(tools/e2e/fault_registry.py) has: "
                           f"{', '.join(BY_NAME)}") from None


def choices(entry_point: str) -> tuple[str, ...]:
    """The names `entry_point`'s `--fault` accepts, in registry order."""
    if entry_point not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {entry_point!r}: {', '.join(ENTRY_POINTS)}")
    return tuple(f.name for f in FAULTS if entry_point in f.entry_points)


def in_mode(mode: str) -> tuple[str, ...]:
    """The names of the faults of `mode`, in registry order."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: {', '.join(MODES)}")
    return tuple(f.name for f in FAULTS if f.mode == mode)


def make_mode(name: str) -> str:
    """The mode `make e2e FAULT=name` runs; UnknownFault when make e2e does not run it
    (the message says what does)."""
    entry = fault(name)
    if not entry.make_e2e:
        raise UnknownFault(f"make e2e does not plant {name!r} ({entry.mode}); "
                           f"its control: {entry.control}")
    return entry.mode


def markdown_table() -> str:
    """The registry as a markdown table (docs/testing.md's generated block `faults`)."""
    lines = ["| fault | mode | `--fault` of | plants | control |", "|---|---|---|---|---|"]
    for f in FAULTS:
        where = ", ".join(f"`{e}`" for e in f.entry_points)
        mode = f.mode + ("" if f.make_e2e or f.mode == PYTEST_CONTROL else ", not in make e2e")
        lines.append(f"| `{f.name}` | {mode} | {where} | {f.plants} | {f.control} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.e2e.fault_registry",
        description="Query the fault registry (what tools/e2e/plan.py asks for make "
                    "e2e). Without a command, print every fault with its mode, what it "
                    "plants and its control.")
    commands = parser.add_subparsers(dest="command")
    listing = commands.add_parser("list", help="fault names, one a line")
    listing.add_argument("--entry", choices=ENTRY_POINTS,
                         help="only those this entry point's --fault accepts")
    listing.add_argument("--mode", choices=MODES, help="only those of this mode")
    deprecated_values(listing, "--mode", OLD_MODES)
    mode = commands.add_parser("mode", help="the mode `make e2e FAULT=NAME` runs")
    mode.add_argument("name")
    make_args = commands.add_parser("make-args", help="harness flags make adds for NAME")
    make_args.add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            names = choices(args.entry) if args.entry else tuple(BY_NAME)
            if args.mode:
                names = tuple(n for n in names if n in in_mode(args.mode))
            print("\n".join(names))
        elif args.command == "mode":
            print(make_mode(args.name))
        elif args.command == "make-args":
            print(" ".join(fault(args.name).make_args))
        else:
            for f in FAULTS:
                print(f"{f.name} ({f.mode}; --fault of {', '.join(f.entry_points)})\n"
                      f"    plants: {f.plants}\n    control: {f.control}")
    except UnknownFault as exc:
        print(f"fault registry: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
