"""The front door and the generated docs (tools/forkbuild/docs.py).

README.md stays short (at most 180 lines, no table cell over 200 characters); its
counts and docs/architecture.md's tables and drawings are generated from the
repository and current; the counts equal what this test counts on its own from
`patches/series` and `prs.toml` (tomllib, not the code under test); no count of
patches, PRs or bases is typed outside a generated block; docs/README.md lists every
page and the front pages' links resolve; every markdown page's links stay inside the
repository, no page names an internal issue or stop number, and benchmarks/README.md's
cells are as short as README.md's. Negative controls on temporary copies: a stale
block, an over-long cell or README (and cell in benchmarks/README.md), an unlisted
page, a broken link, a link outside the repository and an internal number are each
reported, and a new patch that mentions a parameter changes its drawing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tests.fork_build.fakefork import ROOT
from tools.forkbuild import docs
from tools.forkbuild.build import load_series

README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
NUMBER_WORDS = ("one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|"
                "fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty")
TYPED_COUNT = re.compile(
    rf"\b(\d+|{NUMBER_WORDS})(-\w+)?\s+(stacked\s+|upstream\s+|carried\s+)*"
    rf"(patches|PRs|pull requests|bases)\b", re.IGNORECASE)


def block(text: str, name: str) -> str:
    match = re.search(rf"^<!-- generated: {re.escape(name)} -->\n(.*?)^<!-- end generated -->",
                      text, re.MULTILINE | re.DOTALL)
    assert match, f"no generated block {name!r}"
    return match.group(1)


def outside_blocks(text: str) -> str:
    return re.sub(r"^<!-- generated: .*?^<!-- end generated -->", "", text,
                  flags=re.MULTILINE | re.DOTALL)


def independent_counts() -> dict[str, tuple[int, int, int]]:
    """release -> (patches in its series, files under vllm/ and its own vllm/, [[pr]]
    tables in its prs.toml), counted here."""
    def count(base: Path) -> tuple[int, int, int]:
        series = (base / "patches" / "series").read_text().splitlines()
        patches = sum(1 for line in series
                      if line.split("#", 1)[0].strip().endswith(".patch"))
        shared = {p.relative_to(ROOT).as_posix() for p in (ROOT / "vllm").rglob("*.py")}
        own = {p.relative_to(base).as_posix() for p in (base / "vllm").rglob("*.py")}
        prs = len(tomllib.loads((base / "patches" / "prs.toml").read_text())["pr"])
        return patches, len(shared | own), prs

    primary = tomllib.loads((ROOT / "pins.toml").read_text())["base"]["release"]
    counts = {primary: count(ROOT)}
    for pins in sorted((ROOT / "bases").glob("*/pins.toml")):
        counts[pins.parent.name] = count(pins.parent)
    return counts


def copy_repo(tmp_path: Path) -> Path:
    """What the docs are generated from and written to, in a temporary root."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "pins.toml", root)
    shutil.copy(README, root)
    for directory in ("patches", "bases", "docs", "vllm"):
        shutil.copytree(ROOT / directory, root / directory)
    return root


# -- the repository as it is -----------------------------------------------------------

def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 180, f"README.md has {len(lines)} lines"
    cells = docs.table_cells(README.read_text())
    assert len(cells) > 20, "the status table is gone"
    assert docs.readme_problems(README) == []


def test_generated_blocks_are_current() -> None:
    assert docs.update_docs(ROOT, check=True) == []
    text = ARCHITECTURE.read_text()
    for name in ("counts", "patches", "files", "path:routed_experts_prompt_start",
                 "path:enable_routed_experts_transfer", "path:return_routed_experts"):
        assert block(text, name).strip(), name
    assert block(README.read_text(), "counts").strip()


def test_docs_check_command_passes() -> None:
    result = subprocess.run([sys.executable, "-m", "tools.fork", "docs", "--check"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "docs: ok" in result.stdout


def test_counts_equal_independent_counts() -> None:
    want = independent_counts()
    assert len(want) >= 2, "a primary base and at least one carried base"
    for page in (README, ARCHITECTURE):
        lines = block(page.read_text(), "counts").strip().splitlines()
        got = {}
        for line in lines:
            match = re.match(r"^- vLLM (?P<release>\d+\.\d+\.\d+),.*: (?P<patches>\d+) patches "
                             r"and (?P<modules>\d+) modules.*, split into (?P<prs>\d+) PRs",
                             line)
            assert match, f"{page.name}: unexpected counts line {line!r}"
            got[match["release"]] = (int(match["patches"]), int(match["modules"]),
                                     int(match["prs"]))
        assert got == want, page.name
        assert list(got)[0] == tomllib.loads((ROOT / "pins.toml").read_text())["base"]["release"]


def test_no_count_typed_by_hand_in_readme() -> None:
    typed = [match.group(0) for match in TYPED_COUNT.finditer(outside_blocks(README.read_text()))]
    assert typed == []


def test_typed_count_pattern_catches_what_it_should() -> None:
    for text in ("sixteen stacked PRs", "22 patches", "two bases", "18 upstream PRs"):
        assert TYPED_COUNT.search(text), text
    assert not TYPED_COUNT.search("the stacked PRs, one per capability")


def test_every_page_is_indexed_and_links_resolve() -> None:
    assert docs.index_problems(ROOT) == []
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        relative = page.relative_to(ROOT / "docs").as_posix()
        if relative != "README.md":
            assert f"]({relative})" in index, f"docs/README.md does not list {relative}"
    for page in (README, ROOT / "docs" / "README.md", ARCHITECTURE):
        assert docs.link_problems(page, ROOT) == []


def test_every_page_passes_the_page_checks() -> None:
    pages = docs.markdown_pages(ROOT)
    assert ROOT / "benchmarks" / "README.md" in pages
    assert ROOT / "docs" / "design" / "offload-rows-trailer.md" in pages
    assert docs.docs_problems(ROOT) == []


def test_drawing_steps_are_the_patches_added_lines() -> None:
    """Each step's patches add a line naming the parameter to that file (checked on the
    raw patch text), and the steps follow the stage order."""
    series = load_series(ROOT / "patches")
    by_number = {patch.name[:4]: patch for patch in series}
    for parameter in ("routed_experts_prompt_start", "enable_routed_experts_transfer",
                      "return_routed_experts"):
        steps = docs.parameter_steps(series, parameter)
        assert steps, parameter
        order = [name for name, _ in docs.STAGES]
        assert [order.index(s.stage) for s in steps] == sorted(order.index(s.stage) for s in steps)
        for step in steps:
            for number in step.added_by:
                text = by_number[number].path.read_text()
                diff = text.split(f"diff --git a/{step.file} b/{step.file}\n", 1)[1]
                diff = diff.split("\ndiff --git ", 1)[0]
                assert any(line.startswith("+") and parameter in line
                           for line in diff.splitlines()), (parameter, step)
    transfer = {s.file: s for s in docs.parameter_steps(series, "enable_routed_experts_transfer")}
    assert transfer["vllm/config/kv_transfer.py"].stage == "configuration"
    (rows_mirror,) = [patch.name[:4] for patch in series
                      if patch.slug == "keep-routed-experts-rows-per-kv-block-in-a-mirror-a"]
    assert rows_mirror in transfer["vllm/config/kv_transfer.py"].added_by


def test_stages_follow_the_request_path() -> None:
    expected = {
        "vllm/entrypoints/openai/completion/protocol.py": "API protocol",
        "vllm/entrypoints/openai/completion/serving.py": "response",
        "vllm/v1/engine/input_processor.py": "input processing",
        "vllm/v1/core/sched/scheduler.py": "scheduler",
        "vllm/distributed/aux_output_connector/worker.py": "aux-output connector",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py": "KV connector",
        "vllm/v1/worker/gpu/model_runner.py": "worker",
        "vllm/v1/engine/output_processor.py": "output processor",
        "vllm/somewhere/new.py": docs.OTHER_STAGE,
    }
    assert {path: docs.stage_of(path) for path in expected} == expected


# -- negative controls, on temporary copies ---------------------------------------------

def test_a_stale_block_is_reported_and_rewritten(tmp_path: Path) -> None:
    root = copy_repo(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    counts = block(text, "counts")
    wrong = re.sub(r"(\d+) patches", lambda m: f"{int(m[1]) + 1} patches", counts, count=1)
    readme.write_text(text.replace(counts, wrong))
    architecture = root / "docs" / "architecture.md"
    drawing = block(architecture.read_text(), "path:enable_routed_experts_transfer")
    architecture.write_text(architecture.read_text().replace(
        drawing, drawing.replace("vllm/config/kv_transfer.py", "vllm/config/elsewhere.py")))

    problems = docs.update_docs(root, check=True)
    assert problems == [
        "README.md: generated block 'counts' is stale; run `python -m tools.fork docs`",
        "docs/architecture.md: generated block 'path:enable_routed_experts_transfer' is "
        "stale; run `python -m tools.fork docs`",
    ]
    assert readme.read_text() != text  # --check rewrites nothing
    assert len(docs.update_docs(root)) == 2
    assert readme.read_text() == text
    assert docs.update_docs(root, check=True) == []


def test_a_new_patch_changes_the_drawing(tmp_path: Path) -> None:
    root = copy_repo(tmp_path)
    name = "0099-read-the-switch-in-the-worker.patch"
    (root / "patches" / name).write_text(
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "Subject: [PATCH] Read the switch in the worker\n\n"
        "Body.\n---\n"
        "diff --git a/vllm/v1/worker/rows.py b/vllm/v1/worker/rows.py\n"
        "new file mode 100644\n--- /dev/null\n+++ b/vllm/v1/worker/rows.py\n"
        "@@ -0,0 +1,1 @@\n+ENABLED = config.enable_routed_experts_transfer\n")
    with (root / "patches" / "series").open("a") as series:
        series.write(name + "\n")
    problems = docs.update_docs(root, check=True)
    stale = {line.split("'")[1] for line in problems}
    assert {"counts", "patches", "files", "path:enable_routed_experts_transfer"} <= stale
    assert "path:return_routed_experts" not in stale
    docs.update_docs(root)
    drawing = block((root / "docs" / "architecture.md").read_text(),
                    "path:enable_routed_experts_transfer")
    assert re.search(r"↓ worker +vllm/v1/worker/rows\.py +0099$", drawing, re.MULTILINE)


def test_an_over_long_cell_or_readme_is_reported(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# t\n\n| a | b |\n|---|---|\n| ok | " + "x" * 200 + " |\n")
    assert docs.readme_problems(readme) == []
    readme.write_text("# t\n\n| a | b |\n|---|---|\n| ok | " + "x" * 201 + " |\n")
    problems = docs.readme_problems(readme)
    assert len(problems) == 1 and "README.md:5: a table cell of 201 characters" in problems[0]
    readme.write_text("line\n" * 181)
    assert docs.readme_problems(readme) == [
        "README.md has 181 lines (at most 180); move detail to docs/status.md or the topic pages"]


def test_an_unlisted_page_and_a_broken_link_are_reported(tmp_path: Path) -> None:
    root = copy_repo(tmp_path)
    (root / "docs" / "design" / "new-plan.md").write_text("# A new plan\n")
    assert docs.index_problems(root) == ["docs/README.md does not list docs/design/new-plan.md"]
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/gone.md) [bad](docs/cpu.md#no-such)\n")
    problems = docs.link_problems(readme, root)
    assert len(problems) == 2
    assert "link docs/gone.md names no file" in problems[0]
    assert "link docs/cpu.md#no-such: no heading #no-such there" in problems[1]


def test_a_block_without_its_end_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    with pytest.raises(docs.BuildError, match="has no `<!-- end generated -->` line"):
        docs.refresh_text("<!-- generated: counts -->\ntext\n", ROOT, page)
    with pytest.raises(docs.BuildError, match="unknown generated block 'nope'"):
        docs.refresh_text("<!-- generated: nope -->\n<!-- end generated -->\n", ROOT, page)


def _minimal_root(tmp_path: Path) -> Path:
    """A root with just the pages the page checks read, all passing."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "benchmarks").mkdir()
    (root / "README.md").write_text("# t\n\n[docs](docs/README.md)\n")
    (root / "docs" / "README.md").write_text("# The docs\n\n- [page.md](page.md): a page.\n")
    (root / "docs" / "page.md").write_text("# A page\n")
    (root / "benchmarks" / "README.md").write_text("# Benchmarks\n")
    return root


def test_a_link_outside_the_repository_is_reported(tmp_path: Path) -> None:
    root = _minimal_root(tmp_path)
    (tmp_path / "outside.md").write_text("# Outside\n")  # exists, but not in the repo
    page = root / "docs" / "page.md"
    page.write_text("# A page\n\n[in](../README.md) [web](https://example.com/a.md) "
                    "[here](#a-page)\n")
    assert docs.link_problems(page, root) == []
    assert docs.docs_problems(root) == []
    page.write_text("# A page\n\n[up](../../outside.md)\n\n[abs](/work/shared/notes.md)\n"
                    "```\n[fenced](/work/x.md)\n```\n")
    assert docs.link_problems(page, root) == [
        "docs/page.md:3: link ../../outside.md points outside the repository",
        "docs/page.md:5: link /work/shared/notes.md points outside the repository (an "
        "absolute path); link a file of the repository, relative to the page",
    ]
    assert docs.docs_problems(root) == docs.link_problems(page, root)


def test_an_internal_number_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Upstream references and other numbers stay\n\n"
        "vLLM #1234, RFC #55584, vllm-project/vllm#1, llm-d#1473, upstream PR #45224.\n"
        "As upstream issue 12 and vLLM issue 77 say; [issue 5](https://github.com/o/r/issues/5).\n"
        "The server did not stop 30 s after SIGKILL; `git log --grep 'issue 9'`.\n"
        "```\nissue 7\n```\n")
    assert docs.internal_number_problems(page, tmp_path) == []
    page.write_text("# Internal numbers\n\nAs issue 48 says. Stop 26's CI run (#48).\n"
                    "Until issues 14 and 15.\n")
    problems = docs.internal_number_problems(page, tmp_path)
    assert [problem.split(" names ")[0] for problem in problems] == [
        "page.md:3: 'issue 48'", "page.md:3: 'Stop 26'", "page.md:3: '(#48)'",
        "page.md:4: 'issues 14'"]
    assert all("links nowhere" in problem for problem in problems)


def test_an_over_long_cell_in_the_benchmarks_readme_is_reported(tmp_path: Path) -> None:
    assert docs.cell_problems((ROOT / "benchmarks" / "README.md").read_text(),
                              "benchmarks/README.md") == []
    root = _minimal_root(tmp_path)
    benchmarks = root / "benchmarks" / "README.md"
    benchmarks.write_text("# B\n\n| a | b |\n|---|---|\n| ok | " + "x" * 200 + " |\n")
    assert docs.docs_problems(root) == []
    benchmarks.write_text("# B\n\n| a | b |\n|---|---|\n| ok | " + "x" * 201 + " |\n")
    assert docs.docs_problems(root) == [
        "benchmarks/README.md:5: a table cell of 201 characters (at most 200): "
        + "x" * 60 + "..."]


CHANGES_PATCH = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: A Person <a@example.com>
Subject: [PATCH] [Core] A change

Body.

Signed-off-by: A Person <a@example.com>
---
diff --git a/vllm/thing.py b/vllm/thing.py
--- a/vllm/thing.py
+++ b/vllm/thing.py
@@ -10,6 +10,12 @@ class Thing:
     def keep(self) -> None:
         pass
 
+    def fresh(self) -> int:
+        return 1
+
     def edited(self) -> int:
-        return 1
+        return 2
@@ -40,3 +46,3 @@ def helper(x):
-def renamed(a):
+def renamed(a, b):
     return a
diff --git a/vllm/other.py b/vllm/other.py
--- a/vllm/other.py
+++ b/vllm/other.py
@@ -1,3 +1,4 @@ class Other:
     x = 1
+    y = 2
     z = 3
"""


def test_change_rows_name_what_each_file_adds_and_changes(tmp_path: Path) -> None:
    # Expected by reading the hand-written diff above: `fresh` is new; `edited` holds
    # a changed line; `renamed` is removed and added again; `Other` holds an added
    # line, named only by its hunk header.
    path = tmp_path / "0001-a-change.patch"
    path.write_text(CHANGES_PATCH)
    patch = docs.Patch(name=path.name, path=path, subject="[Core] A change", body="",
                       files=())
    assert docs.patch_file_changes(patch) == {
        "vllm/thing.py": (["fresh"], ["renamed", "edited"]),
        "vllm/other.py": ([], ["Other"]),
    }
    assert docs._what(["fresh"], ["renamed", "edited"]) == (
        "adds `fresh`; changes `renamed`, `edited`")
    assert docs._names([f"n{i}" for i in range(7)], limit=5) == (
        "`n0`, `n1`, `n2`, `n3`, `n4` and 2 more")


def test_a_changes_block_naming_no_pr_is_an_error() -> None:
    series = load_series(ROOT / "patches")
    plan = docs.load_plan(docs.plan_path(ROOT / "patches"))
    with pytest.raises(docs.BuildError, match="no PR named not-a-pr"):
        docs.render_changes(series, plan, ["not-a-pr"], ROOT)


def test_the_rows_transfer_page_lists_each_pr_s_files() -> None:
    text = (ROOT / "docs" / "r3-pd-rows-transfer.md").read_text()
    table = block(text, "changes:aux-output-worker-hook,routed-experts-rows-mirror,"
                        "routed-experts-rows-with-kv")
    plan = tomllib.loads((ROOT / "patches" / "prs.toml").read_text())
    prs = {pr["name"]: pr for pr in plan["pr"]}
    for name in ("aux-output-worker-hook", "routed-experts-rows-mirror",
                 "routed-experts-rows-with-kv"):
        for module in prs[name].get("modules", []):
            assert f"| `{name}` | (module) | [{module}]" in table
    assert "| `vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py` | adds " \
           "`_register_rows_mirror`" in table


def test_pr_sizes_equal_git_s_own_count() -> None:
    # Independent of the code under test: `git apply --numstat` counts each patch's
    # added and removed lines, and the modules' lines are counted here.
    release = "0.34.0"
    patches_dir = ROOT / "bases" / release / "patches"
    plan = tomllib.loads((patches_dir / "prs.toml").read_text())
    files = {re.sub(r"^\d{4}-", "", path.stem): path for path in patches_dir.glob("*.patch")}
    table = block((ROOT / "docs" / "upstream-prs.md").read_text(), "prs")
    sizes = {row.split("|")[2].strip(" `"): int(row.split("|")[6])
             for row in table.splitlines() if re.match(r"^\| \d+ \|", row)}
    for pr in plan["pr"]:
        expected = 0
        for slug in pr["patches"]:
            numstat = subprocess.run(["git", "apply", "--numstat", str(files[slug])],
                                     capture_output=True, text=True, check=True).stdout
            expected += sum(int(a) + int(r) for a, r, _ in
                            (line.split("\t") for line in numstat.splitlines()))
        for module in pr.get("modules", []):
            own = ROOT / "bases" / release / module
            expected += len((own if own.exists() else ROOT / module).read_text().splitlines())
        assert sizes[pr["name"]] == expected, pr["name"]
