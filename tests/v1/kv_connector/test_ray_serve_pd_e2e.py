"""The fork served by Ray Serve LLM 2.60.0's own P/D app (`build_pd_openai_app`) on
a local multi-node Ray cluster on CPU: prefill and decode replicas on different
raylets (custom resources), both roles built with `--routed-experts-transfer`.
Ray's orchestrator keeps only prefill's `kv_transfer_params`, so the rows its
ingress returns are decode's: they must equal a colocated `vllm serve`'s rows and
tokens, unary and streamed (docs/deployments/ray-serve.md).

Needs Ray Serve beside the fork (tools/setup-ray-serve-env.sh creates .venv-ray;
`make e2e-ray-serve` sets it up and runs this file there); in a venv without it the
test fails, naming the setup script. make test and make e2e leave it out (marker
`ray_serve`).
Each deployment takes 3 to 5 minutes to come up on 2 cores; the reference is served
once for both shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.testbed import ray_serve_pd
from tools.testbed.tiny_moe import build

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_full, pytest.mark.ray_serve,
              pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ray_serve_pd.require_ray_serve()
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=8, num_experts_per_tok=2, seed=0)
    return path


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> list[ray_serve_pd.Answer]:
    bodies = [ray_serve_pd.request_body(p) for p in ray_serve_pd.prompts()]
    return ray_serve_pd.reference_answers(model, bodies,
                                          tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("num_prefill", [1, 2], ids=["1P1D", "2P1D"])
def test_ray_serve_pd_app_returns_rows_equal_to_colocated(
    tmp_path: Path, model: Path, reference: list[ray_serve_pd.Answer],
    num_prefill: int,
) -> None:
    report = ray_serve_pd.run(tmp_path, model, num_prefill, reference=reference)
    # Prefill replicas on the prefill raylet, decode on the decode raylet, the
    # ingress on the head: the custom resources placed them.
    placement = report["placement"]
    assert placement["prefill-node"] == ["pd:Prefill:tiny"] * num_prefill, placement
    assert placement["decode-node"] == ["pd:Decode:tiny"], placement
    assert placement["head"] == ["pd:OpenAiIngress"], placement
    # Every prompt (twice with two prefills), plus one streamed.
    assert len(report["prompts"]) == 3 * (2 if num_prefill > 1 else 1) + 1, report
    # Each answer was decoded by the fork's client decoder, which checks one row per
    # position from 0 to P + C - 1: complete rows, not decode's half.
    assert report["mismatches"] == 0, report["prompts"]
