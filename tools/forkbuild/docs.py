"""Generated blocks in the fork's markdown, and the checks on its pages.

Some facts in the docs are the repository's own data and must not be typed by hand:
how many patches and PRs each base carries, which patch touches which vLLM file, and
where a central parameter travels through vLLM. A page holds them between markers:

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

`python -m tools.fork docs` rewrites every block of README.md and docs/**/*.md in
place from `patches/series`, `prs.toml`, `pins.toml`, `bases/` and the fault
registry (tools/e2e/fault_registry.py); `--check`
rewrites nothing and names each stale block, and also checks the pages
(`docs_problems`): README.md's length, the table cells of README.md and
benchmarks/README.md, the docs index, and on every markdown page of the repository
its links (each names a file or heading inside the repository) and references to
the project's own issue or stop numbers, which link nowhere. Block names:

- `counts`: per base, its release, where it lives, its patches, modules and PRs;
- `patches`: one row per patch of the primary series (number, file, PR, files touched);
- `files`: one row per vLLM file the primary series touches: its stage, the patches;
- `modules`: one row per fork module (vllm/): its lines, its PR, the bases with their
  own copy;
- `path:PARAM`: a drawing of PARAM's way through vLLM, one line per file the series
  touches or the fork adds whose lines mention it, in stage order (`STAGES`), naming
  the patches that add those lines ("module" for the fork's own modules), or
  "upstream" where it appears only in a patch's context;
- `faults`: the planted faults of the negative controls, one row per entry of
  tools/e2e/fault_registry.py.

Everything here is a pure function of the repository's files: rendering twice gives
the same bytes.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import BuildError
from .build import base_dir, base_releases, load_series, newest_release
from .crossbase import change_blocks
from .modules import common_modules, fork_modules, override_modules
from .pins import load_pins
from .prs import PrPlan, PullRequest, load_plan, plan_path
from .series import Patch

BEGIN = re.compile(r"^<!-- generated: (?P<name>[A-Za-z0-9_:.,-]+) -->$")
END = "<!-- end generated -->"
README = "README.md"
DOCS_DIR = "docs"
DOCS_INDEX = "docs/README.md"
README_MAX_LINES = 180
CELL_MAX_CHARS = 200
# Pages besides README.md whose table cells are held to CELL_MAX_CHARS.
CELL_LIMITED_PAGES = ("benchmarks/README.md",)
# Where markdown pages live besides README.md (walked for links and internal numbers).
MARKDOWN_DIRS = ("docs", "benchmarks", "pdproxy", "tests", "tools")

# Where a file sits on a request's way through vLLM: the first stage whose pattern
# (fnmatch, `*` crosses `/`) matches its path. The order is the drawings' order.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("configuration", ("vllm/config/*", "vllm/envs.py", "vllm/entrypoints/cli/*",
                       "vllm/distributed/kv_transfer/role_chains.py")),
    ("API protocol", ("vllm/entrypoints/*protocol.py",)),
    ("input processing", ("vllm/sampling_params.py", "vllm/v1/engine/input_processor.py")),
    ("scheduler", ("vllm/v1/core/sched/*",)),
    ("aux-output connector", ("vllm/distributed/aux_output_connector/*",)),
    ("KV connector", ("vllm/distributed/kv_transfer/*", "vllm/v1/kv_offload/*")),
    ("worker", ("vllm/v1/worker/*", "vllm/v1/sample/*")),
    ("output processor", ("vllm/v1/engine/output_processor.py", "vllm/v1/engine/__init__.py",
                          "vllm/outputs.py")),
    ("response", ("vllm/entrypoints/*serving.py", "vllm/exceptions.py")),
    ("client", ("vllm/entrypoints/routed_experts.py",)),
    ("metrics", ("vllm/v1/metrics/*",)),
    ("platform", ("vllm/triton_utils/*", "vllm/platforms/*")),
)
OTHER_STAGE = "other"
# Where a drawing's step is a fork module (vllm/), not a patch.
MODULE = "module"


@dataclass(frozen=True)
class BaseCount:
    release: str
    primary: bool
    where: str  # the base's directory, relative to the repository root ("" for the root)
    patches: int
    prs: int
    modules: int = 0  # the fork's modules this base ships
    own_modules: int = 0  # of those, the base's own copies (bases/<release>/vllm/)
    opened: int = 0  # PRs opened upstream (prs.toml `upstream`)


@dataclass(frozen=True)
class Step:
    """One file on a parameter's way: who adds lines naming it, or where upstream has it."""

    stage: str
    file: str
    added_by: tuple[str, ...]  # patch numbers whose added lines mention the parameter
    context_of: tuple[str, ...]  # patch numbers that show it only in context lines


# -- the data ---------------------------------------------------------------------------

def number(patch: Patch) -> str:
    """`0011-transfer-....patch` -> `0011`."""
    return patch.name.split("-", 1)[0]


def stage_of(path: str) -> str:
    for stage, patterns in STAGES:
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns):
            return stage
    return OTHER_STAGE


def _stage_key(stage: str) -> int:
    names = [name for name, _ in STAGES]
    return names.index(stage) if stage in names else len(names)


def base_counts(root: Path) -> list[BaseCount]:
    """Every base (the primary first): its series length and its PR map's length."""
    counts = []
    primary = load_pins(root / "pins.toml").release
    for release in base_releases(root):
        patches_dir = base_dir(root, release) / "patches"
        plan = load_plan(plan_path(patches_dir), release)
        where = base_dir(root, release).relative_to(root).as_posix()
        directory = base_dir(root, release)
        counts.append(BaseCount(release, release == primary, "" if where == "." else where,
                                len(load_series(patches_dir)), len(plan.prs),
                                len(fork_modules(root, directory)),
                                len(override_modules(root, directory)),
                                sum(pr.opened for pr in plan.prs)))
    return counts


def files_touched(series: list[Patch]) -> dict[str, list[Patch]]:
    """Every file the series touches -> the patches that touch it, in series order."""
    touched: dict[str, list[Patch]] = {}
    for patch in series:
        for diff in patch.files:
            touched.setdefault(diff.path, []).append(patch)
    return touched


def _context_lines(patch: Patch) -> dict[str, list[str]]:
    """Per file, the patch's context lines (the unchanged ones its hunks show)."""
    files: dict[str, list[str]] = {}
    current = None
    for line in patch.path.read_text().splitlines():
        if line.startswith("diff --git "):
            current = line.split(" ")[-1][2:]
            files.setdefault(current, [])
        elif current is not None and line.startswith(" "):
            files[current].append(line[1:])
    return files


def parameter_steps(series: list[Patch], parameter: str,
                    modules: dict[str, Path] | None = None) -> list[Step]:
    """Where `parameter` appears in the series' files and the fork's modules, in stage
    order, then path."""
    word = re.compile(rf"\b{re.escape(parameter)}\b")
    added: dict[str, list[str]] = {}
    context: dict[str, list[str]] = {}
    for path, source in (modules or {}).items():
        if word.search(source.read_text()):
            added.setdefault(path, []).append(MODULE)
    for patch in series:
        for path, blocks in change_blocks(patch).items():
            if any(word.search(line) for block in blocks for line in block.added):
                added.setdefault(path, []).append(number(patch))
        for path, lines in _context_lines(patch).items():
            if any(word.search(line) for line in lines):
                context.setdefault(path, []).append(number(patch))
    paths = sorted(set(added) | set(context), key=lambda p: (_stage_key(stage_of(p)), p))
    return [Step(stage_of(path), path, tuple(added.get(path, ())),
                 () if path in added else tuple(context[path]))
            for path in paths]


# -- rendering --------------------------------------------------------------------------

def _link(prefix: str, target: str, text: str | None = None) -> str:
    return f"[{text or target}]({prefix}{target})"


def render_counts(counts: list[BaseCount], prefix: str = "") -> str:
    lines = []
    for count in counts:
        where = count.where + "/" if count.where else ""
        if count.primary:
            role = (f"the primary base ({_link(prefix, 'pins.toml')}, "
                    f"{_link(prefix, where + 'patches/series')})")
        else:
            role = f"carried ({_link(prefix, where)})"
        own = f", {count.own_modules} of them its own copies" if count.own_modules else ""
        opened = (f"{count.opened} of them opened upstream" if count.opened
                  else "none opened upstream yet")
        lines.append(f"- vLLM {count.release}, {role}: {count.patches} patches and "
                     f"{count.modules} modules{own}, split into {count.prs} PRs, "
                     f"{opened} ({_link(prefix, where + 'patches/prs.toml', 'prs.toml')})")
    return "\n".join(lines)


def _pr_of(plan: PrPlan) -> dict[str, str]:
    return {slug: pr.name for pr in plan.prs for slug in pr.patches}


def render_patches(series: list[Patch], plan: PrPlan, prefix: str = "") -> str:
    pr_of = _pr_of(plan)
    rows = ["| patch | file | PR (prs.toml) | vLLM files |", "|---|---|---|---|"]
    for patch in series:
        rows.append(f"| {number(patch)} | {_link(prefix, 'patches/' + patch.name, patch.slug)} "
                    f"| {pr_of.get(patch.slug, '(none)')} | {len(patch.files)} |")
    return "\n".join(rows)


def changed_lines(patch: Patch) -> int:
    """The lines `patch` removes or adds (a reviewer's count; headers excluded)."""
    count, in_diff = 0, False
    for line in patch.path.read_text().splitlines():
        if line.startswith("diff --git "):
            in_diff = True
        elif in_diff and line.startswith(("+", "-")) and not line.startswith(("+++", "---")):
            count += 1
    return count


def pr_size(pr: PullRequest, series: list[Patch], modules: dict[str, Path]) -> int:
    """A PR's diff as a reviewer reads it: its patches' changed lines plus every line
    of the modules it adds (`modules`: the base's, by path)."""
    by_slug = {patch.slug: patch for patch in series}
    return (sum(changed_lines(by_slug[slug]) for slug in pr.patches)
            + sum(len(modules[path].read_text().splitlines()) for path in pr.modules))


def render_prs(plan: PrPlan, series: list[Patch], modules: dict[str, Path]) -> str:
    """One row per upstream PR, in landing order: what it carries, its size and
    where it stands."""
    rows = ["| # | PR | title | patches | modules | lines | answers | unit / e2e tests "
            "| upstream |", "|---|---|---|---|---|---|---|---|---|"]
    for index, pr in enumerate(plan.prs, start=1):
        patches = ", ".join(f"`{slug}`" for slug in pr.patches) or "(modules only)"
        names = ", ".join(f"`{Path(path).name}`" for path in pr.modules) or "-"
        answers = ", ".join(pr.answers) or "-"
        title = pr.title.replace("|", "\\|")
        rows.append(f"| {index} | `{pr.name}` | {title} | {patches} | {names} "
                    f"| {pr_size(pr, series, modules)} | {answers} "
                    f"| {len(pr.tests)} / {len(pr.e2e_tests)} | {pr.upstream} |")
    return "\n".join(rows)


def render_files(series: list[Patch]) -> str:
    touched = files_touched(series)
    rows = ["| stage | vLLM file | patches |", "|---|---|---|"]
    for path in sorted(touched, key=lambda p: (_stage_key(stage_of(p)), p)):
        rows.append(f"| {stage_of(path)} | `{path}` | "
                    f"{' '.join(number(patch) for patch in touched[path])} |")
    return "\n".join(rows)


def render_modules(root: Path, plan: PrPlan, prefix: str = "") -> str:
    """One row per fork module: its file, its lines, its PR, and the bases with their
    own copy."""
    owner = {path: pr.name for pr in plan.prs for path in pr.modules}
    own: dict[str, list[str]] = {}
    for release in base_releases(root)[1:]:
        for path in override_modules(root, base_dir(root, release)):
            own.setdefault(path, []).append(release)
    rows = ["| module | lines | PR (prs.toml) | own copy on |", "|---|---|---|---|"]
    for path, source in common_modules(root).items():
        lines = len(source.read_text().splitlines())
        rows.append(f"| {_link(prefix, path, path.removeprefix('vllm/'))} | {lines} | "
                    f"{owner.get(path, '(none)')} | {', '.join(own.get(path, [])) or '-'} |")
    return "\n".join(rows)


_DEFINES = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)")
_CONTEXT = re.compile(r"(?:async\s+)?(?:def|class)\s+(\w+)")
CHANGES_MAX_NAMES = 5


def _names(names: list[str], limit: int = CHANGES_MAX_NAMES) -> str:
    """`names` in code font, the first `limit` of them and how many more."""
    unique = list(dict.fromkeys(names))
    shown = ", ".join(f"`{name}`" for name in unique[:limit])
    more = len(unique) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def patch_file_changes(patch: Patch) -> dict[str, tuple[list[str], list[str]]]:
    """Per file of `patch`: the functions and classes it adds (defined on added
    lines, not removed ones), and those it changes: a definition removed and added
    again, or the nearest `def` or `class` above a changed line (in the hunk, or
    named by its header), in file order."""
    files: dict[str, tuple[list[str], list[str], list[str]]] = {}
    added: list[str] = []
    removed: list[str] = []
    touched: list[str] = []
    enclosing: str | None = None
    for line in patch.path.read_text().splitlines():
        if line.startswith("diff --git "):
            added, removed, touched = [], [], []
            files[line.split(" ")[-1][2:]] = (added, removed, touched)
        elif line.startswith("@@"):
            header = _CONTEXT.search(line.split("@@", 2)[-1])
            enclosing = header.group(1) if header else None
        elif line.startswith(("+++", "---")) or not files:
            continue
        elif match := _DEFINES.match(line[1:]):
            enclosing = match.group(1)
            {"+": added, "-": removed}.get(line[0], []).append(enclosing)
        elif line.startswith(("+", "-")) and line[1:].strip() and enclosing:
            touched.append(enclosing)
    changes: dict[str, tuple[list[str], list[str]]] = {}
    for path, (added, removed, touched) in files.items():
        new = list(dict.fromkeys(name for name in added if name not in removed))
        changes[path] = (new, list(dict.fromkeys(
            name for name in [*removed, *touched] if name not in new)))
    return changes


def _what(defined: list[str], changed: list[str]) -> str:
    parts = []
    if defined:
        parts.append("adds " + _names(defined))
    if changed:
        parts.append("changes " + _names(changed))
    return "; ".join(parts) or "module-level lines"


def _module_summary(source: Path) -> str:
    """The first sentence of a module's docstring (how the module states its job)."""
    text = source.read_text()
    match = re.search(r'"""(.+?)(?:\.\s|\.?""")', text, re.DOTALL)
    summary = " ".join(match.group(1).split()) if match else source.name
    return summary.replace("|", "\\|").replace("``", "`")


def render_changes(series: list[Patch], plan: PrPlan, pr_names: list[str],
                   root: Path, prefix: str = "") -> str:
    """One row per file each named PR's patches change (the definitions they add or
    change, read off the patch) and per module it adds (its docstring's first
    sentence), in landing order."""
    by_slug = {patch.slug: patch for patch in series}
    known = {pr.name: pr for pr in plan.prs}
    unknown = [name for name in pr_names if name not in known]
    if unknown:
        raise BuildError(f"generated block changes: no PR named {', '.join(unknown)} "
                         f"in {plan.path}")
    rows = ["| PR | patch | where | what |", "|---|---|---|---|"]
    for pr in plan.prs:
        if pr.name not in pr_names:
            continue
        for slug in pr.patches:
            link = _link(prefix, "patches/" + by_slug[slug].name, f"`{slug}`")
            for path, (defined, changed) in patch_file_changes(by_slug[slug]).items():
                rows.append(f"| `{pr.name}` | {link} | `{path}` | {_what(defined, changed)} |")
        for path in pr.modules:
            rows.append(f"| `{pr.name}` | (module) | {_link(prefix, path)} (new) | "
                        f"{_module_summary(root / path)} |")
    return "\n".join(rows)


def render_path(parameter: str, steps: list[Step]) -> str:
    """A text drawing: one line per step, an arrow where the stage changes."""
    if not steps:
        raise BuildError(f"no patch of the series mentions {parameter!r}: drop its drawing "
                         f"(<!-- generated: path:{parameter} -->) or fix the name")
    stage_width = max(len(step.stage) for step in steps)
    file_width = max(len(step.file) for step in steps)
    lines = ["```text", parameter]
    previous = None
    for step in steps:
        who = (", ".join(step.added_by) if step.added_by
               else f"upstream (context of {', '.join(step.context_of)})")
        lead = "↓ " if previous is not None and step.stage != previous else "  "
        stage = step.stage if step.stage != previous else ""
        lines.append(f"  {lead}{stage:<{stage_width}}  {step.file:<{file_width}}  {who}".rstrip())
        previous = step.stage
    lines.append("```")
    return "\n".join(lines)


def render_block(name: str, root: Path, doc: Path) -> str:
    """The content of block `name` in the page at `doc` (links relative to the page)."""
    prefix = os.path.relpath(root, doc.parent).replace(os.sep, "/") + "/"
    prefix = "" if prefix == "./" else prefix
    primary_patches = root / "patches"
    if name == "counts":
        return render_counts(base_counts(root), prefix)
    if name == "patches":
        release = load_pins(root / "pins.toml").release
        return render_patches(load_series(primary_patches),
                              load_plan(plan_path(primary_patches), release), prefix)
    if name == "files":
        return render_files(load_series(primary_patches))
    if name == "prs":
        release = newest_release(root)
        patches_dir = base_dir(root, release) / "patches"
        return render_prs(load_plan(plan_path(patches_dir), release), load_series(patches_dir),
                          fork_modules(root, base_dir(root, release)))
    if name == "modules":
        release = load_pins(root / "pins.toml").release
        return render_modules(root, load_plan(plan_path(primary_patches), release), prefix)
    if name.startswith("path:"):
        parameter = name.split(":", 1)[1]
        return render_path(parameter, parameter_steps(load_series(primary_patches), parameter,
                                                      common_modules(root)))
    if name.startswith("changes:"):
        release = load_pins(root / "pins.toml").release
        return render_changes(load_series(primary_patches),
                              load_plan(plan_path(primary_patches), release),
                              name.split(":", 1)[1].split(","), root, prefix)
    if name == "faults":
        from tools.e2e.fault_registry import markdown_table  # standard library only

        return markdown_table()
    raise BuildError(f"{doc}: unknown generated block {name!r}; known: counts, patches, "
                     f"files, prs, modules, path:PARAMETER, changes:PR[,PR...], faults")


# -- blocks in pages --------------------------------------------------------------------

def refresh_text(text: str, root: Path, doc: Path) -> tuple[str, list[str]]:
    """`text` with every generated block re-rendered, and the names of those that changed."""
    lines = text.split("\n")
    out: list[str] = []
    stale: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        out.append(line)
        index += 1
        match = BEGIN.match(line)
        if match is None:
            continue
        name = match.group("name")
        try:
            end = lines.index(END, index)
        except ValueError:
            raise BuildError(f"{doc}:{index}: block {name!r} has no `{END}` line") from None
        nested = [n for n in range(index, end) if BEGIN.match(lines[n])]
        if nested:
            raise BuildError(f"{doc}:{nested[0] + 1}: a block starts inside block {name!r} "
                             f"(line {index}); close it with `{END}` first")
        new = ["", *render_block(name, root, doc).split("\n"), ""]
        if lines[index:end] != new:
            stale.append(name)
        out.extend(new)
        out.append(END)
        index = end + 1
    return "\n".join(out), stale


def pages(root: Path) -> list[Path]:
    """The markdown pages that may hold blocks: README.md and docs/**/*.md."""
    return [root / README, *sorted((root / DOCS_DIR).rglob("*.md"))]


def update_docs(root: Path, check: bool = False) -> list[str]:
    """Rewrite every stale block (or with `check`, only report them). Returns one line
    per stale block: `<page>: block <name> ...`."""
    found = []
    for page in pages(root):
        text = page.read_text()
        new, stale = refresh_text(text, root, page)
        relative = page.relative_to(root).as_posix()
        for name in stale:
            found.append(f"{relative}: generated block {name!r} is stale"
                         + ("; run `python -m tools.fork docs`" if check else "; rewritten"))
        if stale and not check:
            page.write_text(new)
    return found


# -- the pages' checks -----------------------------------------------------------------

def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    kept, fenced = [], False
    for number_, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append((number_, line))
    return kept


def table_cells(text: str) -> list[tuple[int, str]]:
    """(line number, cell) for every cell of every markdown table row (outside fences)."""
    cells = []
    for number_, line in _outside_fences(text):
        if not line.lstrip().startswith("|"):
            continue
        body = line.strip().strip("|")
        cells.extend((number_, cell.strip())
                     for cell in re.split(r"(?<!\\)\|", body))
    return cells


def cell_problems(text: str, name: str, max_cell: int = CELL_MAX_CHARS) -> list[str]:
    """One line per table cell of `text` over `max_cell` characters (`name` is the
    page as the messages name it)."""
    return [f"{name}:{line}: a table cell of {len(cell)} characters (at most {max_cell}): "
            f"{cell[:60]}..."
            for line, cell in table_cells(text) if len(cell) > max_cell]


def readme_problems(path: Path, max_lines: int = README_MAX_LINES,
                    max_cell: int = CELL_MAX_CHARS) -> list[str]:
    """The front door stays short: at most `max_lines` lines, no cell over `max_cell`."""
    text = path.read_text()
    problems = []
    lines = len(text.splitlines())
    if lines > max_lines:
        problems.append(f"{path.name} has {lines} lines (at most {max_lines}); move detail "
                        f"to docs/status.md or the topic pages")
    problems.extend(cell_problems(text, path.name, max_cell))
    return problems


_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to `-`."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for _, line in _outside_fences(path.read_text())
            if line.startswith("#")}


def link_problems(path: Path, root: Path) -> list[str]:
    """Every relative link of the page stays inside the repository and names a file (or
    directory) that exists, and a `#anchor` into a markdown page names one of its
    headings. An absolute path (`/work/...`, `file:`) or a relative one that climbs
    above the repository root names a file only on the machine that wrote it."""
    problems = []
    top = root.resolve()
    for line, text in _outside_fences(path.read_text()):
        for match in _LINK.finditer(text):
            target = match.group("target")
            where = f"{path.relative_to(root).as_posix()}:{line}"
            if target.startswith(("/", "~", "file:")) or re.match(r"^[A-Za-z]:[\\/]", target):
                problems.append(f"{where}: link {target} points outside the repository (an "
                                f"absolute path); link a file of the repository, relative "
                                f"to the page")
                continue
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            file_part, _, fragment = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path.resolve()
            if not resolved.is_relative_to(top):
                problems.append(f"{where}: link {target} points outside the repository")
            elif not resolved.exists():
                problems.append(f"{where}: link {target} names no file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{where}: link {target}: no heading #{fragment} there")
    return problems


def index_problems(root: Path) -> list[str]:
    """docs/README.md links every page under docs/."""
    index = root / DOCS_INDEX
    if not index.is_file():
        return [f"{DOCS_INDEX} does not exist"]
    linked = {(index.parent / match.group("target").partition("#")[0]).resolve()
              for _, line in _outside_fences(index.read_text())
              for match in _LINK.finditer(line)}
    return [f"{DOCS_INDEX} does not list {page.relative_to(root).as_posix()}"
            for page in sorted((root / DOCS_DIR).rglob("*.md"))
            if page != index and page.resolve() not in linked]


# A reference to the project's own tracker ("issue 48", "stop 26", "(#48)") links
# nowhere for a reader of the repository: say what was decided or measured instead.
# Upstream references stay: their number follows the project it belongs to
# ("vLLM #1234", "RFC #55584", "vllm-project/vllm#1", "llm-d#1473", "upstream issue
# 12"), or sits in a link to where it lives.
INTERNAL_NUMBER = re.compile(r"\b(?:issues?|stop)\s+#?\d+\b(?!\s*(?:%|s\b|ms\b|min))|\(#\d+\)",
                             re.IGNORECASE)
UPSTREAM_BEFORE = re.compile(r"(?:\b(?:vllm|llm-d|upstream|rfc|github|nixl|mooncake|ucx|"
                             r"pytorch|torch|triton|transformers)|/[\w.-]+)['’]?s?[\s(]*$",
                             re.IGNORECASE)
_INLINE_CODE = re.compile(r"`[^`]*`")
_URL_LINK = re.compile(r"\[[^\]]*\]\([a-z]+:[^)]*\)")


def internal_number_problems(path: Path, root: Path) -> list[str]:
    """Every reference to an internal issue or stop number on the page, outside code."""
    problems = []
    for line, text in _outside_fences(path.read_text()):
        text = _URL_LINK.sub(lambda m: " " * len(m.group(0)),
                             _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text))
        for match in INTERNAL_NUMBER.finditer(text):
            if UPSTREAM_BEFORE.search(text[:match.start()]):
                continue
            problems.append(f"{path.relative_to(root).as_posix()}:{line}: "
                            f"'{match.group(0)}' names an internal issue or stop, which "
                            f"links nowhere; say what it decided, or name the upstream "
                            f"project (vLLM #1234)")
    return problems


def markdown_pages(root: Path) -> list[Path]:
    """README.md and every markdown page under MARKDOWN_DIRS."""
    found = [root / README]
    for directory in MARKDOWN_DIRS:
        if (root / directory).is_dir():
            found.extend(sorted((root / directory).rglob("*.md")))
    return found


def front_page_problems(root: Path) -> list[str]:
    """README.md's size, its cells, the docs index, and the links of both."""
    problems = [*readme_problems(root / README), *index_problems(root),
                *link_problems(root / README, root)]
    if (root / DOCS_INDEX).is_file():
        problems.extend(link_problems(root / DOCS_INDEX, root))
    return problems


def docs_problems(root: Path) -> list[str]:
    """What `docs --check` reports besides stale blocks: the front pages
    (`front_page_problems`), the cells of CELL_LIMITED_PAGES, and on every markdown
    page its links and internal numbers."""
    problems = front_page_problems(root)
    for name in CELL_LIMITED_PAGES:
        if (root / name).is_file():
            problems.extend(cell_problems((root / name).read_text(), name))
    front = {root / README, root / DOCS_INDEX}
    for page in markdown_pages(root):
        if page not in front:
            problems.extend(link_problems(page, root))
        problems.extend(internal_number_problems(page, root))
    return problems
