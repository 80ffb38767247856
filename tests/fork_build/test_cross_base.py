"""One source of truth across bases (tools/forkbuild/crossbase.py): the real series
make the same change on 0.31.0 and 0.34.0 apart from the recorded differences; a
patch that only moved (new line numbers, new context) is the same patch; one
changed added line on one base is caught, and so is a stale record. A carried
base's own copy of a fork module must be recorded and must still differ."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.fork_build.fakefork import PATCH_GOOD, ROOT
from tools.forkbuild import BuildError
from tools.forkbuild.crossbase import (
    Absent,
    Block,
    Intended,
    change_blocks,
    IntendedModule,
    check_bases,
    compare_bases,
    compare_modules,
    load_absent,
    load_intended,
    load_intended_modules,
)
from tools.forkbuild.series import parse_patch

NAME = "0001-greet-politely.patch"
# The same change with other line numbers and other context: what carrying a patch
# to a release that moved the code around gives.
MOVED = PATCH_GOOD.replace(
    "@@ -1,5 +1,5 @@\n def greet(name: str) -> str:",
    "@@ -41,5 +41,5 @@ class Greeter:\n def greet(name: str) -> str:",
).replace("\n def part() -> int:", "\n def other_part() -> int:")
# One added line changed: the fault the check exists for.
DRIFTED = PATCH_GOOD.replace(
    '+    return "good day, " + name', '+    return "good day " + name'
)
RECORD = Path("bases/9.9.0/intended-differences.toml")


def _patch(tmp_path: Path, text: str, where: str) -> object:
    path = tmp_path / where / NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return parse_patch(path)


def _compare(
    tmp_path: Path, carried_text: str, intended: list[Intended] = ()
) -> list[str]:
    ours = [_patch(tmp_path, PATCH_GOOD, "a")]
    theirs = [_patch(tmp_path, carried_text, "b")]
    return compare_bases(ours, theirs, "9.8.7", "9.9.0", list(intended), RECORD)


def test_the_real_series_agree_apart_from_the_recorded_differences() -> None:
    assert check_bases(ROOT) == []
    recorded = load_intended(ROOT / "bases/0.34.0/intended-differences.toml")
    # A snapshot (regression check): a new intended difference must be added
    # here on purpose, so a reviewer sees the list grow.
    assert [entry.patch for entry in recorded] == [
        "allow-routed-experts-capture-with-nixlconnector-p-d",
        "emit-p-d-decode-routed-experts-from-the-decode",
        "return-the-absolute-start-position-of-routed-experts",
        "bound-offload-loads-to-positions-without-routed",
        "cut-local-prefix-hits-at-kv-blocks-filled-by",
        "keep-routed-experts-rows-per-kv-block-in-a-mirror-a",
        # The rows mirror handed through set_aux_output_worker: the model runner's
        # and the NIXL worker's hunks are placed by each base's code.
        "hand-the-auxiliary-output-worker-to-the-kv-connector",
        "transfer-routed-experts-rows-with-the-kv-over-nixl",
        "fail-closed-when-decode-reads-blocks-released-on",
        "say-why-a-request-failed-when-its-kv-could-not-be",
        "carry-routed-experts-rows-with-offloaded-kv-chunks",
        "count-routed-experts-rows-and-control-plane-state",
        "run-the-native-offload-worker-on-the-cpu-platform",
        "store-routed-experts-rows-beside-mooncake-store",
        # Added by the move from 0.33.0 to 0.34.0.
        "bound-offload-loads-to-positions-without-routed",
        "run-the-native-offload-worker-on-the-cpu-platform",
        "keep-routed-experts-rows-per-kv-block-in-a-mirror-a",
        "say-why-a-request-failed-when-its-kv-could-not-be",
        "return-routed-experts-rows-in-the-final-stream-chunk",
        "store-routed-experts-rows-beside-mooncake-store",
        # One lookup per decision: 0.34.0's lookup shares HIT and HIT_PENDING.
        "carry-routed-experts-rows-through-secondary-offload",
        # The CPU platform's own model runner on 0.34.0 makes the same late call.
        "handle-kv-connector-preemptions-before-the-runner",
        # 0.34.0 has no local-hit cut for an adopter to skip.
        "load-a-kv-hand-off-once-for-every-request-that",
    ]


def test_blocks_are_the_removed_and_added_lines_per_file(tmp_path: Path) -> None:
    assert change_blocks(_patch(tmp_path, PATCH_GOOD, "a")) == {
        "vllm/greeting.py": [
            Block(('    return "hello " + name',), ('    return "good day, " + name',))
        ],
    }


def test_context_and_line_numbers_do_not_count(tmp_path: Path) -> None:
    assert MOVED != PATCH_GOOD
    assert _compare(tmp_path, MOVED) == []


def test_one_changed_added_line_is_caught(tmp_path: Path) -> None:
    [problem] = _compare(tmp_path, DRIFTED)
    assert problem == (
        "greet-politely: vllm/greeting.py: the change differs between 9.8.7 and 9.9.0 "
        "(1 of 1 blocks changed, 1 of 1 on the other side; first at block 1, its line 2: "
        "'+    return \"good day, \" + name' vs '+    return \"good day \" + name'). Make the "
        "same change on both bases, or record "
        f"why it differs in {RECORD}"
    )


def test_a_recorded_difference_passes_and_a_stale_record_fails(tmp_path: Path) -> None:
    record = [
        Intended("greet-politely", ("vllm/greeting.py",), "the 9.9 greeting is terser")
    ]
    assert _compare(tmp_path, DRIFTED, record) == []
    [stale] = _compare(tmp_path, MOVED, record)
    assert stale == (
        f"{RECORD}: greet-politely: vllm/greeting.py is recorded as differing, "
        "but its change is the same on both bases (or the patch does not touch "
        "it); remove it from the record"
    )


def test_a_record_must_say_why(tmp_path: Path) -> None:
    path = tmp_path / "intended-differences.toml"
    path.write_text(
        '[[difference]]\npatch = "greet-politely"\nfiles = ["vllm/greeting.py"]\n'
    )
    with pytest.raises(
        BuildError, match=r"#1 \(greet-politely\): field 'reason' must say why"
    ):
        load_intended(path)


def test_different_slugs_are_refused(tmp_path: Path) -> None:
    ours = [_patch(tmp_path, PATCH_GOOD, "a")]
    other = tmp_path / "b" / "0001-greet-warmly.patch"
    other.parent.mkdir(parents=True)
    other.write_text(PATCH_GOOD)
    [problem] = compare_bases(ours, [parse_patch(other)], "9.8.7", "9.9.0", [], RECORD)
    assert problem.startswith(
        "the series differ: 9.8.7 has ['greet-politely'], 9.9.0 has ['greet-warmly']"
    )


def _named(tmp_path: Path, where: str, *names: str) -> list[object]:
    """PATCH_GOOD under each file name (a patch's slug comes from its name)."""
    patches = []
    for name in names:
        path = tmp_path / where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PATCH_GOOD)
        patches.append(parse_patch(path))
    return patches


def test_a_recorded_absence_lets_a_carried_base_skip_one_patch(tmp_path: Path) -> None:
    ours = _named(tmp_path, "a", "0001-greet-politely.patch", "0002-fix-a-kernel.patch",
                  "0003-greet-warmly.patch")
    theirs = _named(tmp_path, "b", "0001-greet-politely.patch", "0002-greet-warmly.patch")
    fixed_upstream = Absent("fix-a-kernel", "9.9.0 has the fix upstream")
    assert compare_bases(ours, theirs, "9.8.7", "9.9.0", [], RECORD, [fixed_upstream]) == []
    [problem] = compare_bases(ours, theirs, "9.8.7", "9.9.0", [], RECORD)
    assert problem.startswith("the series differ: 9.8.7 has ['greet-politely', "
                              "'fix-a-kernel', 'greet-warmly'], 9.9.0 has")
    # The order of the patches both carry still counts.
    swapped = list(reversed(theirs))
    [problem] = compare_bases(ours, swapped, "9.8.7", "9.9.0", [], RECORD, [fixed_upstream])
    assert problem.startswith("the series differ: 9.8.7 has ['greet-politely', "
                              "'greet-warmly'], 9.9.0 has ['greet-warmly', 'greet-politely']")


def test_an_absence_that_is_not_true_is_refused(tmp_path: Path) -> None:
    ours = _named(tmp_path, "a", "0001-greet-politely.patch")
    theirs = _named(tmp_path, "b", "0001-greet-politely.patch")
    carried = Absent("greet-politely", "no longer needed")
    assert compare_bases(ours, theirs, "9.8.7", "9.9.0", [], RECORD, [carried]) == [
        f"{RECORD}: [[absent]] 'greet-politely': 9.9.0 carries it; remove the "
        f"record, or the patch"
    ]
    unknown = Absent("greet-rudely", "never was")
    assert compare_bases(ours, theirs, "9.8.7", "9.9.0", [], RECORD, [unknown]) == [
        f"{RECORD}: [[absent]] 'greet-rudely' is not a patch of the primary base's "
        f"series; remove the record"
    ]


def test_an_absence_without_a_reason_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "intended-differences.toml"
    path.write_text('[[absent]]\npatch = "fix-a-kernel"\n')
    with pytest.raises(BuildError, match=r"\[\[absent\]\] #1 \(fix-a-kernel\): field "
                       r"'reason' must say why"):
        load_absent(path)


def test_a_fault_planted_in_the_real_034_series_is_caught(tmp_path: Path) -> None:
    """The real series with one added line of the 0.34.0 kv-transfer-config patch
    changed (a patch recorded as making the same change on both bases)."""
    from tools.forkbuild.build import load_series

    ours = load_series(ROOT / "patches")
    theirs = load_series(ROOT / "bases/0.34.0/patches")
    [index] = [
        i
        for i, patch in enumerate(theirs)
        if patch.slug == "add-vllm-kv-transfer-config-per-role-p-d-connector"
    ]
    victim = theirs[index]
    text = victim.path.read_text()
    line = next(l for l in text.splitlines() if l.startswith("+    import "))
    tampered = tmp_path / victim.name
    tampered.write_text(text.replace(line, line + "  # renamed_", 1))
    theirs[index] = parse_patch(tampered)
    record = ROOT / "bases/0.34.0/intended-differences.toml"
    problems = compare_bases(
        ours, theirs, "0.31.0", "0.34.0", load_intended(record), RECORD,
        load_absent(record),
    )
    assert len(problems) == 1
    assert problems[0].startswith(f"{victim.slug}: ")
    assert "the change differs between 0.31.0 and 0.34.0" in problems[0]
    assert "renamed_" in problems[0]


def test_the_real_bases_own_copies_are_the_recorded_ones() -> None:
    # A snapshot (regression check): an own copy of a module on 0.34.0 is added here
    # on purpose, so a reviewer sees the list grow.
    recorded = load_intended_modules(ROOT / "bases/0.34.0/intended-differences.toml")
    assert [entry.path for entry in recorded] == [
        "vllm/distributed/aux_output_connector/connector_policy.py",
        "vllm/distributed/aux_output_connector/offload.py",
        "vllm/distributed/aux_output_connector/loaded_blocks.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/rows.py",
    ]
    own = sorted(p.relative_to(ROOT / "bases/0.34.0").as_posix()
                 for p in (ROOT / "bases/0.34.0/vllm").rglob("*.py"))
    assert own == sorted(entry.path for entry in recorded)


def _modules(tmp_path: Path, shared: str, own: str) -> tuple[dict, dict]:
    path = "vllm/x/added.py"
    for where, text in (("vllm", shared), ("bases/9.9.0/vllm", own)):
        target = tmp_path / where / "x/added.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return ({path: Path("vllm/x/added.py")},
            {path: Path("bases/9.9.0/vllm/x/added.py")})


def test_an_unrecorded_own_copy_of_a_module_is_caught(tmp_path: Path) -> None:
    shared, own = _modules(tmp_path, "A = 1\n", "A = 2\n")
    [problem] = compare_modules(shared, own, [], "9.9.0", RECORD, tmp_path)
    assert problem == (
        "bases/9.9.0/vllm/x/added.py: vLLM 9.9.0 has its own copy of vllm/x/added.py; "
        f"record why in {RECORD} ([[module]] path, reason), or delete it so the base "
        "ships the shared vllm/ copy"
    )
    record = [IntendedModule("vllm/x/added.py", "A differs upstream.")]
    assert compare_modules(shared, own, record, "9.9.0", RECORD, tmp_path) == []


def test_an_own_copy_that_no_longer_differs_is_stale(tmp_path: Path) -> None:
    shared, own = _modules(tmp_path, "A = 1\n", "A = 1\n")
    record = [IntendedModule("vllm/x/added.py", "A differed once.")]
    [problem] = compare_modules(shared, own, record, "9.9.0", RECORD, tmp_path)
    assert problem.startswith("bases/9.9.0/vllm/x/added.py is the same as the shared")
    [gone] = compare_modules(shared, {}, record, "9.9.0", RECORD, tmp_path)
    assert gone == (f"{RECORD}: [[module]] vllm/x/added.py is recorded, but vLLM 9.9.0 "
                    "has no own copy of it; remove the record")


def test_a_module_record_without_a_reason_is_refused(tmp_path: Path) -> None:
    record = tmp_path / "intended-differences.toml"
    record.write_text('[[module]]\npath = "vllm/x/added.py"\nreason = " "\n')
    with pytest.raises(BuildError) as err:
        load_intended_modules(record)
    assert str(err.value) == (
        f"{record}: [[module]] #1 (vllm/x/added.py): field 'reason' must say why this "
        "base needs its own copy"
    )
