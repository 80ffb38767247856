#!/usr/bin/env python3
"""The fork's command line: build the wheel and work on the patch series.

    python tools/fork.py build    [--base cuda|cpu] [--arch ARCH] [-o dist]
    python tools/fork.py version  [--base cuda|cpu]
    python tools/fork.py checkout [--base cuda|cpu] [--dir build/vllm-src] [--force]
    python tools/fork.py export   [--dir build/vllm-src]
    python tools/fork.py check    [--only-selected]
    python tools/fork.py drift    --release X.Y.Z [--base cuda|cpu] [--arch ARCH]
    python tools/fork.py export-prs [-o build/prs]
    python tools/fork.py check-prs  [--python .venv/bin/python]
    python tools/fork.py cpu-standin-requirements --base-release X.Y.Z
    python tools/fork.py upstream-tests [--python PY] [--record] [--full]

Every command takes --base-release X.Y.Z to work on another carried base
(bases/X.Y.Z/; default: the primary base in pins.toml). `check` without it
checks every base.

The loop (docs/patch-workflow.md): checkout, edit and commit in the working
tree (one commit per patch, its message the PR description), export, test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from forkbuild import BuildError  # noqa: E402
from forkbuild.build import BuildRequest, build_fork_wheel, request_from_env  # noqa: E402
from forkbuild.pins import VARIANTS, load_pins  # noqa: E402
from forkbuild.version import fork_label, fork_version  # noqa: E402
from forkbuild import drift, prs, standin, workflow  # noqa: E402
from forkbuild.build import base_label, base_releases, load_series, resolve  # noqa: E402
from forkbuild.fetch import default_cache_dir  # noqa: E402


def _request(args: argparse.Namespace) -> BuildRequest:
    if args.base:
        os.environ["VLLM_FORK_BASE"] = args.base
    if args.base_release:
        os.environ["VLLM_FORK_RELEASE"] = args.base_release
    if args.arch:
        os.environ["VLLM_FORK_ARCH"] = args.arch
    return request_from_env(ROOT, Path(getattr(args, "output", "dist")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fork.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--base", choices=VARIANTS,
                       help="base wheel variant (default: $VLLM_FORK_BASE or cuda)")
        p.add_argument("--arch", help="base wheel architecture (default: this machine)")
        p.add_argument("--base-release", metavar="X.Y.Z",
                       help="the vLLM release whose series to use: the primary base "
                            f"(pins.toml) or one under bases/ (default: $VLLM_FORK_RELEASE "
                            f"or the primary base); supported: "
                            f"{', '.join(base_releases(ROOT))}")
        return p

    p = add("build", "build the fork wheel into a directory")
    p.add_argument("-o", "--output", default="dist", help="output directory (default: dist)")
    add("version", "print the version the build would stamp")
    p = add("checkout", "materialise a git working tree: base commit + one commit per patch")
    p.add_argument("--dir", default="build/vllm-src", help="where (default: build/vllm-src)")
    p.add_argument("--force", action="store_true", help="replace an existing working tree")
    p = add("export", "export the working tree's commits into patches/ and rewrite the series")
    p.add_argument("--dir", default="build/vllm-src", help="the working tree (default: build/vllm-src)")
    p = add("check", "apply the series to every pinned base and review patch headers")
    p.add_argument("--only-selected", action="store_true",
                   help="check only the base selected by --base/--arch")
    p = add("drift", "report, per patch, how the series applies to another upstream release")
    p.add_argument("--release", required=True,
                   help="the upstream release to check (e.g. 0.33.0); its wheel is fetched "
                        "with pip into the base-wheel cache")
    add("cpu-standin-requirements",
        "print the requirements of a CPU stand-in for a base without a CPU build "
        "(the base's, without the GPU-only ones; see tools/forkbuild/standin.py)")
    p = add("export-prs", "write the series as upstream PRs, one per capability "
                          "(patches/prs.toml)")
    p.add_argument("-o", "--output", default="build/prs",
                   help="output directory, replaced (default: build/prs)")
    p = add("check-prs", "apply the PRs in order to the pinned release's sources and run "
                         "each PR's unit tests there")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="the interpreter with the fork installed and the test dependencies "
                        "(default: .venv/bin/python, from make test)")
    p = add("upstream-tests", "run upstream vLLM's own tests (from the pinned sdist) on the "
                              "fork and compare with the recorded stock outcomes "
                              "(tools/forkbuild/upstream_tests.py)")
    p.add_argument("--python", help="the interpreter to test (default: .venv or "
                                    ".venv-<release>, the fork's test venv)")
    p.add_argument("--record", action="store_true",
                   help="record stock outcomes into tests/upstream/stock-<release>.json "
                        "(--python must be a stock venv: tools/setup-stock-env.sh)")
    p.add_argument("--full", action="store_true", help="include the slow upstream files")
    p.add_argument("--area", action="append", default=[],
                   help="only this upstream test path (repeatable; default: every area)")
    args = parser.parse_args(argv)

    try:
        request = _request(args)
        if args.command == "build":
            print(build_fork_wheel(request))
        elif args.command == "version":
            pins = load_pins(request.pins_path)
            pins.select(request.variant, request.arch)  # a base that is pinned
            print(fork_version(pins.release, fork_label(ROOT), request.variant))
        elif args.command == "checkout":
            workflow.checkout(request, Path(args.dir), force=args.force)
        elif args.command == "export":
            for path in workflow.export(Path(args.dir), request.patches_dir):
                print(path.relative_to(ROOT))
        elif args.command == "drift":
            pins = load_pins(request.pins_path)
            wheel = pins.select(request.variant, request.arch)
            release = drift.fetch_release(wheel.project, args.release, wheel.platform,
                                          request.cache_dir or default_cache_dir())
            label = f"{wheel.project} {args.release} ({request.variant}/{wheel.arch} base)"
            patches = load_series(request.patches_dir)
            print(drift.markdown(label, release, drift.release_drift(release, patches, label)))
        elif args.command == "cpu-standin-requirements":
            print("\n".join(standin.cpu_standin_requirements(request)))
        elif args.command == "export-prs":
            plan = prs.load_plan(request.patches_dir / "prs.toml")
            out = Path(args.output)
            out = out if out.is_absolute() else ROOT / out
            for path in prs.export_prs(plan, load_series(request.patches_dir), ROOT, out):
                print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        elif args.command == "check-prs":
            plan = prs.load_plan(request.patches_dir / "prs.toml")
            pins, wheel, base = resolve(request)
            installed = subprocess.run(
                [args.python, "-c", "import pathlib, vllm; "
                 "print(pathlib.Path(vllm.__file__).parent)"],
                check=True, capture_output=True, text=True).stdout.strip()
            problems = prs.check_prs(plan, load_series(request.patches_dir), ROOT, base,
                                     base_label(pins, wheel), Path(installed), args.python)
            for problem in problems:
                print(f"check-prs: {problem}", file=sys.stderr)
            if problems:
                return 1
            print("check-prs: ok")
        elif args.command == "upstream-tests":
            from forkbuild import upstream_tests
            return upstream_tests.main(request, args.python, args.record, args.full,
                                       sys.argv[1:] if argv is None else argv,
                                       tuple(args.area))
        elif args.command == "check":
            if args.only_selected or args.base_release:
                problems = workflow.check(request, all_pins=not args.only_selected)
            else:
                problems = [
                    problem for release in base_releases(ROOT)
                    for problem in workflow.check(replace(request, release=release))
                ]
            for problem in problems:
                print(f"check: {problem}", file=sys.stderr)
            if problems:
                return 1
            print("check: ok")
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
