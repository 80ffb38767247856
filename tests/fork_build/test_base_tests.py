"""Which carried base runs which test file (tools/forkbuild/base_tests.py), on a
hand-made tree of two bases."""

from __future__ import annotations

from pathlib import Path

from tools.forkbuild.base_tests import other_bases_only, listed_by_base


def _base(directory: Path, release: str, tests: list[str], e2e: list[str]) -> None:
    (directory / "patches").mkdir(parents=True)
    (directory / "pins.toml").write_text(f'[base]\nrelease = "{release}"\n')
    listed = ", ".join(f'"{t}"' for t in tests)
    served = ", ".join(f'"{t}"' for t in e2e)
    (directory / "patches" / "prs.toml").write_text(
        f'[[pr]]\nname = "a"\ntests = [{listed}]\ne2e_tests = [{served}]\n'
    )


def test_a_file_runs_on_the_bases_that_list_it(tmp_path: Path) -> None:
    _base(tmp_path, "0.31.0", ["tests/both.py", "tests/old_shape.py"], ["tests/e2e.py"])
    _base(tmp_path / "bases" / "0.34.0", "0.34.0",
          ["tests/both.py", "tests/new_shape.py"], ["tests/e2e.py"])
    assert listed_by_base(tmp_path) == {
        "0.31.0": {"tests/both.py", "tests/old_shape.py", "tests/e2e.py"},
        "0.34.0": {"tests/both.py", "tests/new_shape.py", "tests/e2e.py"},
    }
    assert other_bases_only(tmp_path, "0.31.0") == {"tests/new_shape.py"}
    assert other_bases_only(tmp_path, "0.34.0") == {"tests/old_shape.py"}
    # A release no base carries runs only what no base lists: nothing is left out
    # that every base lists, everything a base lists is.
    assert other_bases_only(tmp_path, "0.99.0") == {
        "tests/both.py", "tests/old_shape.py", "tests/new_shape.py", "tests/e2e.py"}


def test_the_series_own_base_specific_files() -> None:
    """This repository: each base leaves out the other's shape of the PRs whose
    behaviour upstream changed between them (docs/bases.md)."""
    root = Path(__file__).resolve().parents[2]
    assert other_bases_only(root, "0.34.0") == {
        "tests/config/test_aux_output_model_runner_gate.py",
        "tests/config/test_aux_output_unbounded_loaders_rejected.py",
        "tests/v1/core/test_aux_output_local_hit_cut.py",
        "tests/v1/kv_offload/test_shared_region_slot.py",
    }
    assert other_bases_only(root, "0.31.0") == {
        "tests/config/test_aux_output_unbounded_loaders_capped.py",
        "tests/distributed/aux_output_connector/test_offload_load_limit_retained_rows.py",
        "tests/v1/core/test_aux_output_retained_rows_cap.py",
        "tests/v1/kv_connector/unit/test_offload_rows_failed_jobs.py",
    }
