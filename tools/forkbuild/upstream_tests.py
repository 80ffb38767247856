"""Upstream vLLM's own unit tests, run against the fork and compared with stock.

Contract
--------
`run_fork(...)` runs pytest from the base's pinned sdist (`forkbuild.sdist`) on
the areas the series touches, with an interpreter that has the fork installed,
and compares every test's outcome with the stock outcomes recorded for that
base (`tests/upstream/stock-<release>.json`). A test that passed on stock and
fails, errors, or is no longer collected on the fork is a regression; the run
fails on any. Tests that fail or error on stock too (they need a GPU, a model
download, ...) are never regressions; they are counted. `record_stock(...)`
runs the same selection with a stock interpreter and writes that JSON (the
outcomes, the command that produced them, the environment); it refuses an
interpreter whose vLLM is the fork.

The upstream tests run from a temporary copy of the sdist's `tests/` tree and
`pyproject.toml` (pytest's configuration), never from the repository: nothing of
upstream is stored here, and there is no `vllm/` beside the tests, so they
import the installed vLLM.

Test updates: "the PR that changes that behaviour carries the test update"
-------------------------------------------------------------------------
A patch of the series may change behaviour an upstream test asserts. Its PR then
has to change that test too, and the fork carries the change as a test-update
patch: `<base>/upstream-tests/NNNN-<what>.patch` (`<base>` is the
repository root for the primary base, `bases/<release>/` for a carried one), a
`git format-patch` file against the sdist's tree (paths `a/tests/...`), whose
message says why, with a trailer line `Upstream-PR: <name>` naming the
`[[pr]]` of `patches/prs.toml` that carries it. The runner applies them, in
name order, to the fork run's copy only; the stock run always uses the tests
as released. A test whose file a test update touches and that the fork run no
longer collects counts as updated, not as a regression.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from . import BuildError
from .build import BuildRequest, base_releases
from .fetch import default_cache_dir
from .model_configs import CONFIGS_DIR, offline_hub
from .pins import load_pins
from .sdist import fetch_sdist
from .standin import standin_env

# The fast set, run in `make test`: upstream's tests of the classes the series changes
# (the routed-experts gate and store, the scheduler, the connectors it declares on and
# composes, HiSparse's and NIXL's startup checks).
FAST_AREAS: tuple[str, ...] = (
    "tests/config/test_aux_output_config.py",
    "tests/distributed/aux_output_connector",
    "tests/test_config.py::test_nixl_dcp_check_skipped_for_submodel_config",
    "tests/test_config.py::test_nixl_dcp_check_rejects_non_mla_model_with_dcp",
    "tests/test_config.py::test_hisparse_requires_v2_model_runner",
    "tests/test_config.py::test_hisparse_rejects_decode_context_parallelism",
    "tests/test_config.py::test_hisparse_rejects_pipeline_parallelism",
    "tests/test_config.py::test_hisparse_rejects_disabled_hybrid_kv_cache_manager",
    "tests/test_config.py::test_hisparse_rejects_disabled_full_isl_reservation",
    "tests/test_config.py::test_hisparse_rejects_non_cuda",
    "tests/test_config.py::test_hisparse_connector_implies_attention_config",
    "tests/test_config.py::test_hisparse_connector_preserves_explicit_attention_config",
    "tests/test_config.py::test_hisparse_connector_without_cuda_still_rejected",
    "tests/test_config.py::test_no_hisparse_connector_keeps_attention_config_unset",
    # Their 0.34.0 names and additions (a release runs the ones it has:
    # areas_in_release).
    "tests/test_config.py::test_hisparse_rejects_full_cudagraph_mode",
    "tests/test_config.py::test_hisparse_rejects_unsupported_platform",
    "tests/test_config.py::test_hisparse_requires_hisparse_connector",
    "tests/test_config.py::test_hisparse_connector_with_unsupported_platform_rejected",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_hisparse_connector.py",
    "tests/v1/kv_connector/unit/test_mooncake_store_scheduler.py",
    "tests/v1/kv_connector/unit/test_mooncake_store_worker.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    # NIXL's own unit files but test_nixl_connector.py (which needs `ray` and starts
    # engines; docs/upstream-tests.md has its by-hand record).
    "tests/v1/kv_connector/unit/test_nixl_connector_hma.py",
    "tests/v1/kv_connector/unit/test_nixl_desc_geometry.py",
    "tests/v1/kv_connector/unit/test_nixl_heartbeat.py",
    "tests/v1/kv_connector/unit/test_nixl_push_connector.py",
    "tests/v1/kv_connector/unit/offloading_connector",
    "tests/v1/kv_offload/test_factory.py",
    "tests/v1/worker/test_gpu_kv_connector.py",
)
# Every area the series touches, whole: `make upstream-tests-full` (too slow for
# `make test` on 2 cores: about 4,000 tests per base).
SLOW_FILES: tuple[str, ...] = (
    "tests/config",
    "tests/test_config.py",
    "tests/v1/core",
    "tests/v1/kv_connector/unit",
    "tests/v1/kv_offload",
)
OUTCOMES = ("passed", "failed", "error", "skipped")
FAILING = ("failed", "error")
PER_TEST_TIMEOUT_S = 120
# Both runs are offline: tests that need a model from the hub fail fast on stock and
# fork alike (instead of retrying for minutes), so every outcome is deterministic.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TRAILER = "Upstream-PR:"
PLUGIN = Path(__file__).with_name("outcomes_plugin.py")
STOCK_DIR = Path("tests") / "upstream"
TEST_DEPS = Path("requirements") / "upstream-tests.txt"


@dataclass(frozen=True)
class Outcome:
    outcome: str  # one of OUTCOMES
    message: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class TestUpdate:
    """One test-update patch: which PR carries it and which upstream files it changes."""

    path: Path
    pr: str
    files: tuple[str, ...]


@dataclass
class Comparison:
    areas: tuple[str, ...]
    stock_counts: dict[str, dict[str, int]]
    fork_counts: dict[str, dict[str, int]]
    regressions: list[tuple[str, str]] = field(default_factory=list)  # (node id, first line)
    updated: list[str] = field(default_factory=list)
    failing_on_stock: int = 0
    passed_both: int = 0
    left_out: int = 0  # not run on the fork: they did not pass on stock


# ---------------------------------------------------------------- test updates


def test_updates_dir(base_dir: Path) -> Path:
    """A base's updates to vLLM's own tests: beside its patches/, not in it, so that
    every patch under patches/ is one its `series` lists."""
    return base_dir / "upstream-tests"


def pr_names(prs_toml: Path) -> set[str]:
    if not prs_toml.is_file():
        return set()
    data = tomllib.loads(prs_toml.read_text())
    return {str(entry.get("name")) for entry in data.get("pr", [])}


def _patched_files(text: str) -> tuple[str, ...]:
    files = []
    for line in text.splitlines():
        if line.startswith("diff --git a/"):
            files.append(line.split(" b/", 1)[0].removeprefix("diff --git a/"))
    return tuple(files)


def parse_test_update(path: Path, known_prs: set[str]) -> TestUpdate:
    """Read one test-update patch; its trailer must name a PR of patches/prs.toml."""
    text = path.read_text()
    header = text.split("\ndiff --git ", 1)[0]
    trailers = [line.removeprefix(TRAILER).strip() for line in header.splitlines()
                if line.startswith(TRAILER)]
    if len(trailers) != 1 or not trailers[0]:
        raise BuildError(f"{path}: a test-update patch needs exactly one "
                         f"'{TRAILER} <name>' line in its message naming the PR that "
                         f"carries it (a [[pr]] name in patches/prs.toml)")
    if trailers[0] not in known_prs:
        raise BuildError(f"{path}: {TRAILER} {trailers[0]!r} is not a [[pr]] name in "
                         f"patches/prs.toml; known: {', '.join(sorted(known_prs)) or 'none'}")
    files = _patched_files(text)
    outside = [name for name in files if not name.startswith("tests/")]
    if not files or outside:
        raise BuildError(f"{path}: a test-update patch changes upstream's tests/ only; "
                         f"it changes {', '.join(outside) or 'nothing'}")
    return TestUpdate(path=path, pr=trailers[0], files=files)


def test_update_paths(directory: Path) -> list[Path]:
    """The test-update patches of `directory`, in the order its `series` file lists
    them. A patch the series does not list, or a listed one that is missing, is an
    error naming it: a test update is never applied, or skipped, by accident."""
    if not directory.is_dir():
        return []
    series = directory / "series"
    if not series.is_file():
        raise BuildError(f"{series} is missing: list the test-update patches of "
                         f"{directory} there, one file name per line, in applying order")
    listed = [line.strip() for line in series.read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    present = sorted(p.name for p in directory.glob("*.patch"))
    unlisted = [name for name in present if name not in listed]
    missing = [name for name in listed if name not in present]
    if unlisted or missing:
        raise BuildError(f"{series} does not match {directory}: "
                         f"not listed: {', '.join(unlisted) or 'none'}; "
                         f"listed but missing: {', '.join(missing) or 'none'}")
    return [directory / name for name in listed]


def load_test_updates(directory: Path, known_prs: set[str]) -> list[TestUpdate]:
    return [parse_test_update(path, known_prs) for path in test_update_paths(directory)]


def apply_test_updates(tree: Path, updates: list[TestUpdate]) -> None:
    for update in updates:
        result = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(update.path)],
            cwd=tree, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"test update {update.path.name} (PR {update.pr}) does not "
                             f"apply to upstream's tests:\n  {result.stderr.strip()}")


# ---------------------------------------------------------------- running pytest


def ensure_test_deps(python: str, requirements: Path, cache: Path) -> Path:
    """Upstream's extra test-harness modules, installed once per (requirements, Python)
    with `pip install --no-deps --target` into `cache`; return that directory."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    key = hashlib.sha256(requirements.read_bytes() + version.encode()).hexdigest()[:16]
    target = cache / "upstream-test-deps" / key
    if (target / ".complete").is_file():
        return target
    if target.exists():
        shutil.rmtree(target)
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--target", str(target), "-r", str(requirements)]
    print(f"upstream-tests: pip {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
        raise BuildError(f"pip could not install {requirements} into {target}; "
                         f"see pip's message above")
    (target / ".complete").write_text("")
    return target


def prepare_tree(source_root: Path, dest: Path, updates: list[TestUpdate]) -> Path:
    """Copy the sdist's tests/ and pyproject.toml into `dest`, then apply `updates`."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source_root / "tests", dest / "tests", symlinks=True)
    shutil.copyfile(source_root / "pyproject.toml", dest / "pyproject.toml")
    apply_test_updates(dest, updates)
    return dest


def pytest_command(python: str, areas: tuple[str, ...], ignore: tuple[str, ...] = ()) -> list[str]:
    cmd = ["nice", "-n", "10", python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "outcomes_plugin", "--continue-on-collection-errors",
           f"--timeout={PER_TEST_TIMEOUT_S}", "-o", "addopts="]
    for path in ignore:
        cmd += ["--ignore", path]
    return [*cmd, *areas]


def default_jobs() -> int:
    """Parallel pytest processes: one per core, at most two (the CI machine's cores)."""
    return max(1, min(2, os.cpu_count() or 1))


def split_areas(tree: Path, areas: tuple[str, ...], jobs: int) -> list[tuple[str, ...]]:
    """`areas` in at most `jobs` groups of about equal weight (bytes of test source;
    a node id weighs a tenth of its file). A directory is split into its test files;
    each group keeps the given order."""
    units: list[str] = []
    for area in areas:
        path = tree / area.split("::")[0]
        if path.is_dir():
            units += [str(f.relative_to(tree)) for f in sorted(path.rglob("test_*.py"))]
        else:
            units.append(area)

    def weight(unit: str) -> int:
        size = (tree / unit.split("::")[0]).stat().st_size
        return size // 10 if "::" in unit else size

    buckets: list[list[str]] = [[] for _ in range(max(1, min(jobs, len(units))))]
    loads = [0] * len(buckets)
    for unit in sorted(units, key=weight, reverse=True):
        lightest = loads.index(min(loads))
        buckets[lightest].append(unit)
        loads[lightest] += weight(unit)
    order = {unit: i for i, unit in enumerate(units)}
    return [tuple(sorted(b, key=order.__getitem__)) for b in buckets if b]


def run_pytest(python: str, tree: Path, areas: tuple[str, ...], env_extra: dict[str, str],
               log: Path, deps: Path | None = None, ignore: tuple[str, ...] = (),
               deselect: frozenset[str] = frozenset(),
               jobs: int = 1) -> dict[str, Outcome]:
    """Run pytest on `areas` inside `tree` (without the `ignore`d files and the
    `deselect`ed node ids); return every test's outcome. With `jobs` > 1 the areas
    are split over that many pytest processes (an area stays in one process, in
    its own order); their logs are joined into `log`."""
    # An area is a path, or a node id (path::test) for a few tests of a slow file.
    missing = [area for area in areas if not (tree / area.split("::")[0]).exists()]
    if missing:
        raise BuildError(f"upstream's tests have no {', '.join(missing)} in this release")
    plugin_dir = tree.parent / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    shutil.copyfile(PLUGIN, plugin_dir / PLUGIN.name)
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    path = [str(plugin_dir)] + ([str(deps)] if deps is not None else [])
    env.update(env_extra, PYTHONPATH=os.pathsep.join(path))
    if deselect:
        listing = tree.parent / "deselect.txt"
        listing.write_text("".join(f"{nodeid}\n" for nodeid in sorted(deselect)))
        env["VLLM_FORK_DESELECT"] = str(listing)
    groups = split_areas(tree, areas, jobs)
    runs = []
    for i, group in enumerate(groups):
        results = tree.parent / f"outcomes-{i}.json"
        part_log = log.with_name(f"{log.name}.{i}")
        out = part_log.open("w")
        proc = subprocess.Popen(pytest_command(python, group, ignore), cwd=tree,
                                env={**env, "VLLM_FORK_OUTCOMES": str(results)},
                                stdout=out, stderr=subprocess.STDOUT)
        runs.append((proc, out, results, part_log))
    for proc, out, _, _ in runs:
        proc.wait()
        out.close()
    # The joined log ends with the last group's summary line, as a single run's would.
    log.write_text("".join(part.read_text() for _, _, _, part in runs))
    outcomes: dict[str, Outcome] = {}
    for _, _, results, part_log in runs:
        if not results.is_file():
            tail = "\n".join(part_log.read_text().splitlines()[-20:])
            raise BuildError(f"pytest wrote no outcomes (log {part_log}):\n{tail}")
        raw = json.loads(results.read_text())
        outcomes.update((nodeid, Outcome(**entry)) for nodeid, entry in raw.items())
    return outcomes


# ---------------------------------------------------------------- comparing


def area_of(nodeid: str, areas: tuple[str, ...]) -> str | None:
    """The area a test belongs to: a path above it, or a node id it is (or is a
    parametrization of)."""
    path = nodeid.split("::", 1)[0]
    for area in areas:
        if "::" in area:
            if nodeid == area or nodeid.startswith(area + "["):
                return area
        elif path == area or path.startswith(area.rstrip("/") + "/"):
            return area
    return None


def count(outcomes: dict[str, str], areas: tuple[str, ...]) -> dict[str, dict[str, int]]:
    counts = {area: dict.fromkeys(OUTCOMES, 0) for area in areas}
    for nodeid, outcome in outcomes.items():
        area = area_of(nodeid, areas)
        if area is not None:
            counts[area][outcome] += 1
    return counts


def _collection_error(nodeid: str, fork: dict[str, Outcome]) -> Outcome | None:
    path = nodeid.split("::", 1)[0]
    entry = fork.get(path)
    return entry if entry is not None and entry.outcome == "error" else None


def compare(stock: dict[str, str], fork: dict[str, Outcome], areas: tuple[str, ...],
            updated_files: tuple[str, ...] = ()) -> Comparison:
    """Stock outcome vs fork outcome, per test, within `areas`."""
    comparison = Comparison(
        areas=areas, stock_counts=count(stock, areas),
        fork_counts=count({k: v.outcome for k, v in fork.items()}, areas))
    for nodeid, before in sorted(stock.items()):
        if area_of(nodeid, areas) is None:
            continue
        if before in FAILING:
            comparison.failing_on_stock += 1
            continue
        if before != "passed":
            continue
        after = fork.get(nodeid) or _collection_error(nodeid, fork)
        if after is None:
            if nodeid.split("::", 1)[0] in updated_files:
                comparison.updated.append(nodeid)
            else:
                comparison.regressions.append((nodeid, "not collected on the fork"))
        elif after.outcome in FAILING:
            comparison.regressions.append((nodeid, after.message or after.outcome))
        elif after.outcome == "passed":
            comparison.passed_both += 1
    for nodeid, after in sorted(fork.items()):
        # A test a test update adds has no stock outcome; it must pass on the fork.
        if (nodeid not in stock and nodeid.split("::", 1)[0] in updated_files
                and after.outcome in FAILING):
            comparison.regressions.append((nodeid, after.message or after.outcome))
    return comparison


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES)


def report_lines(release: str, comparison: Comparison) -> list[str]:
    lines = [f"upstream tests (vLLM {release}), per area: stock | fork (only what "
             f"passed on stock runs there)"]
    for area in comparison.areas:
        lines.append(f"  {area}: {_counts_text(comparison.stock_counts[area])} | "
                     f"{_counts_text(comparison.fork_counts[area])}")
    lines.append(f"  failing or erroring on stock (never regressions; not run on the "
                 f"fork): {comparison.failing_on_stock}")
    if comparison.updated:
        lines.append(f"  replaced by test updates: {len(comparison.updated)}")
    if comparison.regressions:
        lines.append(f"passed on stock, fail on the fork ({len(comparison.regressions)}):")
        lines += [f"  FAILED {nodeid} - {message}" for nodeid, message in comparison.regressions]
    lines.append(f"upstream tests (vLLM {release}): {comparison.passed_both} passed, "
                 f"{len(comparison.regressions)} failed")
    return lines


# ---------------------------------------------------------------- stock record


def stock_path(root: Path, release: str) -> Path:
    return root / STOCK_DIR / f"stock-{release}.json"


def interpreter_facts(python: str, env_extra: dict[str, str]) -> dict[str, str]:
    """Python, torch and vLLM versions of `python`, and the variables the run sets."""
    code = ("import json, platform, sys, importlib.metadata as md, torch, vllm; "
            "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__,"
            " 'vllm': vllm.__version__, 'machine': platform.machine()}))")
    env = dict(os.environ, **env_extra)
    env.pop("PYTHONPATH", None)
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                            cwd=tempfile.gettempdir())
    if result.returncode != 0:
        raise BuildError(f"{python} cannot import torch and vllm:\n{result.stderr[-2000:]}")
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    facts.update({f"env {key}": value for key, value in sorted(env_extra.items())})
    return facts


def is_fork_version(version: str) -> bool:
    return "+r3" in version


def load_stock(path: Path, areas: tuple[str, ...]) -> dict[str, str]:
    if not path.is_file():
        raise BuildError(f"no stock outcomes at {path}; record them with "
                         f"`python -m tools.fork upstream-tests --record --python <stock venv>` "
                         f"(docs/upstream-tests.md)")
    data = json.loads(path.read_text())
    recorded = tuple(data.get("areas", ()))
    missing = [area for area in areas if area not in recorded]
    if missing:
        raise BuildError(f"{path}: records {', '.join(recorded)}, not {', '.join(missing)}; "
                         f"record again with --full to cover every area")
    return dict(data["outcomes"])


def write_stock(path: Path, release: str, sdist_sha256: str, areas: tuple[str, ...],
                command: str, facts: dict[str, str], outcomes: dict[str, Outcome],
                seconds: float) -> None:
    merged = {nodeid: outcome.outcome for nodeid, outcome in outcomes.items()}
    # Why each test that did not pass failed: the first line of its failure.
    messages = {nodeid: outcome.message for nodeid, outcome in outcomes.items()
                if outcome.outcome in FAILING and outcome.message}
    runs = [{"areas": list(areas), "command": command, "seconds": round(seconds)}]
    all_areas = list(areas)
    old = json.loads(path.read_text()) if path.is_file() else None
    if old is not None and old.get("sdist_sha256") == sdist_sha256 \
            and old.get("environment") == facts:
        # Recording some areas again keeps the others' outcomes (same sdist and venv).
        kept = {nodeid: outcome for nodeid, outcome in old["outcomes"].items()
                if area_of(nodeid, areas) is None}
        merged = {**kept, **merged}
        messages = {**{nodeid: message for nodeid, message in old.get("messages", {}).items()
                       if nodeid in kept}, **messages}
        runs = [run for run in old.get("runs", []) if run["areas"] != list(areas)] + runs
        all_areas = [a for a in old["areas"] if a not in areas] + all_areas
    covered = tuple(all_areas)
    data = {
        "release": release,
        "sdist_sha256": sdist_sha256,
        "areas": all_areas,
        "runs": runs,
        "pytest": pytest_command("<python>", ("<areas>",))[3:],
        "environment": facts,
        "counts": count(merged, covered),
        "outcomes": dict(sorted(merged.items())),
        "messages": dict(sorted(messages.items())),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


# ---------------------------------------------------------------- entry points


@dataclass(frozen=True)
class Run:
    release: str
    source_root: Path  # the extracted sdist
    sdist_sha256: str
    python: str
    areas: tuple[str, ...]
    env_extra: dict[str, str]
    base_dir: Path  # where this base's patches/ live
    prs_toml: Path
    deps: Path | None = None  # upstream's extra test-harness modules (ensure_test_deps)
    jobs: int = 1  # parallel pytest processes (run_pytest)


def not_passing_on_stock(stock: dict[str, str],
                         updated_files: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset[str]]:
    """What the fork run leaves out: modules that failed to import on stock (to
    --ignore) and tests that did not pass there (to deselect); neither can regress.
    Files a test update touches always run whole."""
    modules = tuple(sorted(nodeid for nodeid, outcome in stock.items()
                           if "::" not in nodeid and outcome == "error"
                           and nodeid not in updated_files))
    tests = frozenset(nodeid for nodeid, outcome in stock.items()
                      if "::" in nodeid and outcome != "passed"
                      and nodeid.split("::", 1)[0] not in updated_files)
    return modules, tests


def slowest_files(outcomes: dict[str, Outcome], count: int = 8) -> list[tuple[str, float, int]]:
    """Where a run's time went: (file, seconds, tests) for its `count` slowest files."""
    spent: dict[str, float] = {}
    tests: dict[str, int] = {}
    for nodeid, outcome in outcomes.items():
        name = nodeid.split("::", 1)[0]
        spent[name] = spent.get(name, 0.0) + outcome.seconds
        tests[name] = tests.get(name, 0) + 1
    ranked = sorted(spent, key=lambda name: (-spent[name], name))[:count]
    return [(name, round(spent[name], 1), tests[name]) for name in ranked]


def _timed_run(run: Run, updates: list[TestUpdate], label: str,
               ignore: tuple[str, ...] = (),
               deselect: frozenset[str] = frozenset()) -> tuple[dict[str, Outcome], float]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"vllm-upstream-tests-{run.release}-") as tmp:
        tree = prepare_tree(run.source_root, Path(tmp) / "src", updates)
        log = Path(tmp) / "pytest.log"
        print(f"upstream-tests: vLLM {run.release} {label}: pytest {' '.join(run.areas)} "
              f"({run.python})", file=sys.stderr, flush=True)
        try:
            outcomes = run_pytest(run.python, tree, run.areas, run.env_extra, log, run.deps,
                                  ignore, deselect, jobs=run.jobs)
        finally:
            summary = (log.read_text().strip().splitlines() or ["(no output)"])[-1] \
                if log.is_file() else "(no output)"
        print(f"upstream-tests: {label}: {summary}", file=sys.stderr, flush=True)
    for name, seconds, count in slowest_files(outcomes):
        print(f"upstream-tests: {label}: {seconds:7.1f} s in {count:4d} tests of {name}",
              file=sys.stderr, flush=True)
    return outcomes, time.monotonic() - start


def record_stock(run: Run, out: Path, command: str) -> Path:
    facts = interpreter_facts(run.python, run.env_extra)
    if is_fork_version(facts["vllm"]):
        raise BuildError(f"{run.python} runs the fork (vllm {facts['vllm']}); record stock "
                         f"outcomes with a venv of the unpatched base (tools/setup-stock-env.sh)")
    outcomes, seconds = _timed_run(run, [], "stock")
    write_stock(out, run.release, run.sdist_sha256, run.areas, command, facts, outcomes, seconds)
    return out


def run_fork(run: Run, stock_file: Path) -> tuple[Comparison, float]:
    stock = load_stock(stock_file, run.areas)
    facts = interpreter_facts(run.python, run.env_extra)
    if not is_fork_version(facts["vllm"]):
        print(f"upstream-tests: warning: {run.python} has vllm {facts['vllm']}, not the fork",
              file=sys.stderr, flush=True)
    updates = load_test_updates(test_updates_dir(run.base_dir), pr_names(run.prs_toml))
    for update in updates:
        print(f"upstream-tests: test update {update.path.name} (PR {update.pr})",
              file=sys.stderr, flush=True)
    updated = tuple(name for update in updates for name in update.files)
    ignore, deselect = not_passing_on_stock(stock, updated)
    print(f"upstream-tests: the fork runs the tests that passed on stock; left out: "
          f"{len(deselect)} tests and {len(ignore)} modules that did not", file=sys.stderr,
          flush=True)
    outcomes, seconds = _timed_run(run, updates, "fork", ignore, deselect)
    comparison = compare(stock, outcomes, run.areas, updated)
    comparison.left_out = len(deselect) + len(ignore)
    return comparison, seconds


def shell_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(arg) for arg in argv)


def default_python(root: Path, release: str, primary: str) -> str:
    """The fork's test venv for this base, as tools/setup-test-env.sh makes it."""
    venv = root / (".venv" if release == primary else f".venv-{release}")
    return str(venv / "bin" / "python")


def areas_in_release(source_root: Path, areas: tuple[str, ...]) -> tuple[str, ...]:
    """`areas` without the node ids (path::test) whose test function the release's
    file does not define: a test upstream renamed or removed is not an area of
    that release. Paths are kept (run_pytest refuses a missing one)."""
    kept = []
    for area in areas:
        path, _, test = area.partition("::")
        source = source_root / path
        if test and source.is_file() and not re.search(
                rf"^def {re.escape(test)}\(", source.read_text(), re.MULTILINE):
            continue
        kept.append(area)
    return tuple(kept)


def run_for(request: BuildRequest, python: str | None, full: bool,
            areas: tuple[str, ...] = ()) -> Run:
    """The run `tools/fork.py upstream-tests` makes for `request`'s base."""
    pins = load_pins(request.pins_path)
    primary = base_releases(request.root)[0]
    cpu_wheel = any(wheel.variant == "cpu" for wheel in pins.wheels)
    source_root = fetch_sdist(request)
    assert pins.sdist is not None  # fetch_sdist raised otherwise
    chosen = areas or areas_in_release(
        source_root, FAST_AREAS + SLOW_FILES if full else FAST_AREAS)
    interpreter = python or default_python(request.root, pins.release, primary)
    cache = request.cache_dir or default_cache_dir()
    deps = ensure_test_deps(interpreter, request.root / TEST_DEPS, cache)
    # The hub models upstream's tests name, as config.json only (model_configs.py).
    hub = {"HF_HUB_CACHE": str(offline_hub(request.root / CONFIGS_DIR, cache))}
    return Run(
        release=pins.release, source_root=source_root, sdist_sha256=pins.sdist.sha256,
        python=interpreter, deps=deps,
        areas=tuple(chosen),
        # A base without a CPU build runs on the CPU stand-in (docs/bases.md).
        env_extra={**OFFLINE_ENV, **hub, **({} if cpu_wheel else standin_env())},
        base_dir=request.base_dir, prs_toml=request.root / "patches" / "prs.toml")


def main(request: BuildRequest, python: str | None, record: bool, full: bool,
         argv: list[str], areas: tuple[str, ...] = (), jobs: int = 1,
         stock_python: str | None = None) -> int:
    """`tools/fork.py upstream-tests`: record stock outcomes, or compare the fork with them
    (on `areas` only, when given: a quicker look; the stock file must cover them)."""
    run = run_for(request, python, full or record, areas)
    run = Run(**{**run.__dict__, "jobs": jobs})
    out = stock_path(request.root, run.release)
    if record:
        command = shell_command(["python", "-m", "tools.fork", *argv])
        print(f"upstream-tests: wrote {record_stock(run, out, command)}")
        return 0
    if not full and not areas:
        run = Run(**{**run.__dict__, "areas": tuple(a for a in run.areas if a not in SLOW_FILES)})
    if stock_python is not None:
        # Stock outcomes measured now instead of read from the record (the full set has
        # none recorded: over an hour per base).
        out = Path(tempfile.mkdtemp(prefix="upstream-stock-")) / out.name
        command = shell_command(["python", "-m", "tools.fork", *argv])
        record_stock(Run(**{**run.__dict__, "python": stock_python}), out, command)
        print(f"upstream-tests: stock outcomes measured now with {stock_python} ({out})",
              file=sys.stderr, flush=True)
    comparison, seconds = run_fork(run, out)
    for line in report_lines(run.release, comparison):
        print(line)
    print(f"upstream-tests: fork run took {seconds:.0f} s", file=sys.stderr)
    return 1 if comparison.regressions else 0
