"""The harness's P/D shapes (python -m tools.e2e --prefill-tp/--decode-tp/
--async-scheduling, docs/deployment-shapes.md): what each role is served with, and
the command lines it refuses. Expected values are the documented flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.e2e import readiness
from tools.e2e.__main__ import parse_args, reference_first
from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import ClusterSpec
from tools.e2e.readiness import first_request_timeout
from tools.e2e.role_servers import RoleServers, omp_bind, parallel_args
from tools.e2e.harness import pd_only, reference_answer, shape_label
from tools.e2e.scenarios import FULL
from tools.testbed.warm_tp_compile import WORKER_INDUCTOR_ENV
from tools.testbed.warm_tp_compile import main as warm_main


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
    ("argv", "expected"),
    [([], False), (["--decode-tp", "2"], True), (["--prefill-tp", "2"], True),
     (["--async-scheduling"], False), (["--decode-tp", "2", "--no-reference-first"], False),
     (["--reference-first"], True)],
)
def test_the_reference_serves_first_beside_a_tp_role_unless_told(
    argv: list[str], expected: bool
) -> None:
    assert reference_first(parse_args(argv)) is expected


def test_a_reference_first_deployment_has_no_reference_beside_it(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path, decode_tp=2, reference_first=True)
    assert "reference" not in RoleServers(spec, logs=tmp_path).pd_servers()
    beside = ClusterSpec(tmp_path, decode_tp=2)
    assert "reference" in RoleServers(beside, logs=tmp_path).pd_servers()


def test_recorded_answers_stand_in_for_the_reference(tmp_path: Path) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    answer = {"choices": [{"token_ids": [7, 8]}]}
    recorded = {'{"max_tokens": 2, "prompt": [1, 2, 3]}': answer}
    deployment = Cluster(ClusterSpec(tmp_path, reference_first=True), logs=tmp_path,
                         reference_answers=recorded)
    assert reference_answer(deployment, dict(reversed(body.items()))) is answer
    # A turn the reference was never sent is an error, never another turn's answer.
    missing = reference_answer(deployment, {**body, "max_tokens": 3})
    assert "was not sent this request (3 prompt tokens)" in missing["error"]


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


def test_tp_roles_warm_the_embedding_mask_compile_once_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A TP > 1 role's servers find upstream's TP embedding mask compiled: the
    harness runs tools/testbed/warm_tp_compile.py first, with the model's vocab, the
    role's TP and the Inductor settings vLLM's CPU worker sets; once per model and
    TP in a process, never for TP = 1."""
    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    runs: list[tuple[list[str], dict[str, str]]] = []

    def run(command: list[str], env: dict[str, str], **kwargs: object) -> object:
        runs.append((command, env))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(readiness.subprocess, "run", run)
    monkeypatch.setattr(readiness, "_WARMED", set())
    for tp in (1, 2, 2, 4):
        readiness.warm_tp_compile(tmp_path, tp)
    assert [c[c.index("-m") + 1:] for c, _ in runs] == [
        ["tools.testbed.warm_tp_compile", "--vocab-size", "1000", "--tp", "2"],
        ["tools.testbed.warm_tp_compile", "--vocab-size", "1000", "--tp", "4"],
    ]
    for _, env in runs:  # as vllm/platforms/cpu.py sets them for its workers
        assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
        assert env["TORCHINDUCTOR_CPP_DYNAMIC_THREADS"] == "1"


def test_a_failed_warm_up_is_reported_and_left_to_the_servers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 64}}')

    def run(command: list[str], **kwargs: object) -> object:
        return subprocess.CompletedProcess(command, 1, "", "planted: no compiler")

    monkeypatch.setattr(readiness.subprocess, "run", run)
    monkeypatch.setattr(readiness, "_WARMED", set())
    readiness.warm_tp_compile(tmp_path, 2)
    out = capsys.readouterr().out
    assert "warming the TP 2 embedding-mask compile failed (exit 1)" in out
    assert "planted: no compiler" in out
    assert readiness._WARMED == set()  # tried again by the next deployment


def test_the_warm_up_refuses_what_would_compile_the_wrong_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in WORKER_INDUCTOR_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit):
        warm_main(["--vocab-size", "512", "--tp", "1"])
    assert "--tp 1: the mask is compiled only with TP > 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        warm_main(["--vocab-size", "512", "--tp", "2"])
    assert "TORCHINDUCTOR_COMPILE_THREADS" in capsys.readouterr().err
    for key, value in WORKER_INDUCTOR_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit):
        warm_main(["--vocab-size", "512", "--tp", "2", "--lengths", "1", "0"])
    assert "--lengths [1, 0]: each is a token count, 1 or more" in capsys.readouterr().err


# What a TP 2 server's forward hands the mask: each rank's shard, int32 ids under
# inference mode, a one-token step and longer ones (vLLM's VocabParallelEmbedding).
SERVER_CALLS = """
import torch
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding, get_masked_input_and_mask, pad_vocab_size)
padded = pad_vocab_size(512)
with torch.inference_mode():
    for rank in range(2):
        s = VocabParallelEmbedding._get_indices(padded, padded, 512, 512, rank, 2)
        for length in (1, 3, 40):
            ids = torch.arange(length, dtype=torch.int32)
            get_masked_input_and_mask(ids, s.org_vocab_start_index, s.org_vocab_end_index,
                                      s.num_org_vocab_padding, s.added_vocab_start_index,
                                      s.added_vocab_end_index)
"""


def _compiled(cache: Path) -> set[str]:
    return {p.name for p in cache.rglob("*.so")}


def _in_cache(cache: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), **WORKER_INDUCTOR_ENV)
    return subprocess.run([sys.executable, *argv], cwd=readiness.REPO_ROOT, env=env,
                          capture_output=True, text=True, check=False)


def _warm_then_serve(cache: Path, *lengths: str) -> set[str]:
    """Warm `cache`, then make a server's calls in another process: the C++ files
    those calls had to compile themselves."""
    warm = _in_cache(cache, "-m", "tools.testbed.warm_tp_compile", "--vocab-size", "512",
                     "--tp", "2", *lengths)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert "warm_tp_compile: TP 2 embedding mask compiled in" in warm.stdout
    warmed = _compiled(cache)
    assert warmed, sorted(p.name for p in cache.rglob("*"))
    served = _in_cache(cache, "-c", SERVER_CALLS)
    assert served.returncode == 0, served.stderr[-2000:]
    return _compiled(cache) - warmed


def test_after_the_warm_up_a_server_s_calls_compile_no_c_plus_plus(tmp_path: Path) -> None:
    """Real Inductor, caches of their own: after the warm-up, a server's one-token
    and longer steps find every kernel compiled."""
    assert _warm_then_serve(tmp_path / "default") == set()
    # The negative control: warmed without the one-token graph, a decode step's
    # first call compiles C++ of its own, and the check sees it.
    assert _warm_then_serve(tmp_path / "without-1", "--lengths", "5", "17")
