"""The harness's P/D shapes (python -m tools.e2e --prefill-tp/--decode-tp/
--async-scheduling, docs/deployment-shapes.md): what each role is served with, and
the command lines it refuses. Expected values are the documented flags."""

from __future__ import annotations

import pytest

from tools.e2e.__main__ import parse_args
from tools.e2e.cluster import first_request_timeout, omp_bind, parallel_args
from tools.e2e.harness import pd_only, shape_label
from tools.e2e.scenarios import FULL


def test_each_role_gets_its_tp_and_the_async_flag() -> None:
    assert parallel_args(1, False) == ()
    assert parallel_args(2, False) == ("--tensor-parallel-size", "2")
    assert parallel_args(1, True) == ("--async-scheduling",)
    assert parallel_args(4, True) == ("--tensor-parallel-size", "4", "--async-scheduling")


def test_a_tp_role_s_first_request_waits_for_its_first_forward() -> None:
    # A cold compile of a TP > 1 first forward outlasted 300 s on 2 cores.
    assert first_request_timeout(1, 1) == 300.0
    assert first_request_timeout(1, 2) == 1800.0
    assert first_request_timeout(2, 1) == 1800.0


def test_ranks_bind_one_core_each_wrapping_around(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert omp_bind(0, 1) == "0"
    assert omp_bind(1, 2) == "1|0"
    assert omp_bind(0, 3) == "0|1|0"


def test_a_shape_keeps_p_d_scenarios_and_refuses_a_named_colocated_one() -> None:
    kept = pd_only(list(FULL), named=False)
    assert kept and all(s.group != "offload-colocated" for s in kept)
    assert len(kept) == len(FULL) - sum(s.group == "offload-colocated" for s in FULL)
    colocated = [s for s in FULL if s.group == "offload-colocated"][:1]
    with pytest.raises(ValueError, match="offload-colocated-multi-turn is served colocated"):
        pd_only(colocated, named=True)


def test_the_shape_is_named_on_the_first_line() -> None:
    assert shape_label(1, 2, True) == "prefill TP 1 -> decode TP 2, async scheduling"
    assert shape_label(2, 1, False) == "prefill TP 2 -> decode TP 1, sync scheduling"


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--decode-tp", "0"], "--decode-tp 0: a tensor-parallel size is 1 or more"),
     (["--prefill-tp", "-1"], "--prefill-tp -1: a tensor-parallel size is 1 or more"),
     (["--rows-oracle-margin", "-0.1"], "--rows-oracle-margin -0.1: a logit gap is 0 or more")],
)
def test_bad_shapes_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
