"""`make e2e` as data: the commands each end-to-end target runs, for a fault or none.

    python -m tools.e2e.plan [TARGET] [--fault NAME] [--dry-run]

TARGET is a make target (`TARGETS`, default `e2e`); each of them is one line of the
Makefile calling this module, as `make test` is one line calling `tools.fork ci`
(tools/forkbuild/ci.py). `plan()` returns the target's commands in order; the command
line runs them one after another from the repository root, echoing each first as
make does, and stops at the first that fails, exiting with its code. `--dry-run`
prints them instead, one a line.

The plan, without a fault (`FAULT` unset):

- `e2e`: the Mooncake store's setup, pytest over the markers make test leaves out
  (`MAKE_E2E_MARKERS`), the harness with the proxy merge and every endpoint, then
  everything of the two targets below;
- `e2e-routed-experts-transfer`: the harness with the rows-transfer switch on, through
  vllm-router (the scenarios whose rows travel with the KV: P/D and the native
  offload), prefill lost mid-hand-off under both failure policies, every endpoint
  with rows over NIXL;
- `e2e-lease`: decode reading KV released on lease expiry: recompute, fail, and with
  the switch on.

With a fault, `e2e` runs only the run of the fault's mode in the fault registry
(tools/e2e/fault_registry.py): the harness (and the endpoints when
`tools.e2e.pd_endpoints` plants it too) for a proxy-merge fault, the harness of
`e2e-routed-experts-transfer` (with the fault's `make_args`) for a rows-transfer
fault, the lease-expiry run for a lease-expiry fault; a fault `make e2e` does not
plant, or an unknown one, is refused (exit 2) before anything runs. The two other
targets run their first command with the fault and nothing else.

Standard library only (and the fault registry, which is too): make runs it before
anything else is needed.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from tools.testbed.aliases import ROWS_OVER_NIXL
from tools.e2e import fault_registry

ROOT = Path(__file__).resolve().parents[2]

# The make targets this module plans.
E2E = "e2e"
ROUTED_EXPERTS_TRANSFER = "e2e-routed-experts-transfer"
LEASE = "e2e-lease"
TARGETS = (E2E, ROUTED_EXPERTS_TRANSFER, LEASE)

# The pytest markers make e2e runs and make test leaves out (pyproject.toml says what
# each means); the Ray Serve test is make e2e-ray-serve's.
MAKE_E2E_MARKERS = ("e2e_control", "e2e_store", "e2e_full", "pr_stack")
PYTEST_SELECTION = f"({' or '.join(MAKE_E2E_MARKERS)}) and not ray_serve"
MOONCAKE_SETUP = ("bash", "tools/setup-mooncake.sh")

Command = tuple[str, ...]


def _fault_flag(fault: str | None) -> Command:
    return ("--fault", fault) if fault else ()


def routed_experts_transfer(python: str, fault: str | None) -> list[Command]:
    """`make e2e-routed-experts-transfer [FAULT=fault]`."""
    harness = (python, "-m", fault_registry.HARNESS, "--routed-experts-transfer",
               "--router", "vllm-router")
    if fault:
        return [(*harness, *_fault_flag(fault), *fault_registry.fault(fault).make_args)]
    return [
        harness,
        (python, "-m", "tools.e2e.prefill_lost", "--policy", "recompute"),
        (python, "-m", "tools.e2e.prefill_lost", "--policy", "fail"),
        (python, "-m", fault_registry.PD_ENDPOINTS, "--mode", ROWS_OVER_NIXL),
    ]


def lease(python: str, fault: str | None) -> list[Command]:
    """`make e2e-lease [FAULT=fault]`."""
    run = (python, "-m", fault_registry.LEASE_EXPIRY)
    if fault:
        fault_registry.fault(fault)  # refuse an unknown name here, not in the run
        return [(*run, *_fault_flag(fault))]
    return [run, (*run, "--policy", "fail"), (*run, "--routed-experts-transfer")]


def e2e(python: str, fault: str | None) -> list[Command]:
    """`make e2e [FAULT=fault]`."""
    mode = fault_registry.make_mode(fault) if fault else None
    commands = [MOONCAKE_SETUP]
    if mode is None:
        commands.append((python, "-m", "pytest", "tests", "-m", PYTEST_SELECTION))
    if mode in (None, fault_registry.MERGE):
        commands.append((python, "-m", fault_registry.HARNESS, *_fault_flag(fault)))
        if fault is None or fault in fault_registry.choices(fault_registry.PD_ENDPOINTS):
            commands.append((python, "-m", fault_registry.PD_ENDPOINTS, *_fault_flag(fault)))
    if mode in (None, fault_registry.ROWS_TRANSFER):
        commands += routed_experts_transfer(python, fault)
    if mode in (None, fault_registry.LEASE):
        commands += lease(python, fault)
    return commands


PLANS = {E2E: e2e, ROUTED_EXPERTS_TRANSFER: routed_experts_transfer, LEASE: lease}


def plan(target: str, fault: str | None = None, python: str = sys.executable,
         ) -> list[Command]:
    """The commands `make TARGET [FAULT=fault]` runs, in order. Raises
    fault_registry.UnknownFault for a fault the target does not take, and ValueError
    for an unknown target."""
    if target not in PLANS:
        raise ValueError(f"unknown target {target!r}: {', '.join(TARGETS)}")
    return PLANS[target](python, fault or None)


def run(commands: list[Command], root: Path = ROOT) -> int:
    """Run `commands` in order from `root`, each echoed first; the first non-zero
    exit code ends the run and is returned (0 when all pass)."""
    for index, command in enumerate(commands):
        print(shlex.join(command), flush=True)
        code = subprocess.run(command, cwd=root, check=False).returncode
        if code != 0:
            left = len(commands) - index - 1
            print(f"e2e plan: {shlex.join(command)} exited {code}"
                  + (f"; {left} later command{'s' if left > 1 else ''} not run" if left else ""),
                  file=sys.stderr, flush=True)
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.e2e.plan", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", choices=TARGETS, default=E2E,
                        help="the make target whose commands to run (default: e2e)")
    parser.add_argument("--fault", help="a fault of tools/e2e/fault_registry.py "
                                        "(make's FAULT=)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands, one a line, instead of running them")
    args = parser.parse_args(argv)
    try:
        commands = plan(args.target, args.fault)
    except fault_registry.UnknownFault as exc:
        print(f"FAULT={args.fault}: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(shlex.join(command) for command in commands))
        return 0
    return run(commands)


if __name__ == "__main__":
    sys.exit(main())
