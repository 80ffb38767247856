"""The transformers router oracle the harness checks bf16 and heterogeneous-TP rows
against (tools/testbed/router_oracle.py): its top-k is the gate's own choice, exact
rows pass, near-ties pass only below the margin, and systematic faults fail."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tools.testbed.router_oracle import BF16_MARGIN, check_rows, oracle_rows
from tools.testbed.tiny_moe import build

NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    build(path, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, seed=0)
    return path


def _tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(length)]


@torch.inference_mode()
def _gate_output(model_dir: Path, token_ids: list[int], index: int) -> np.ndarray:
    """Output `index` of every gate (0: router logits, 2: its chosen experts),
    stacked to (positions, layers, ...)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _i, out: outputs.append(out[index].clone()))
        for layer in model.model.layers]
    model(input_ids=torch.tensor([token_ids]), use_cache=False)
    for hook in hooks:
        hook.remove()
    return torch.stack(outputs, dim=1).numpy()


def test_oracle_top_k_is_the_gates_choice(model_dir: Path) -> None:
    tokens = _tokens(1, 40)
    oracle = oracle_rows(model_dir, tokens, TOP_K)
    assert oracle.topk.shape == (40, LAYERS, TOP_K)
    assert oracle.gap.shape == (40, LAYERS) and (oracle.gap >= 0).all()
    np.testing.assert_array_equal(np.sort(oracle.topk, -1),
                                  np.sort(_gate_output(model_dir, tokens, 2), -1))


def test_exact_rows_pass_from_any_start(model_dir: Path) -> None:
    oracle = oracle_rows(model_dir, _tokens(2, 40), TOP_K)
    for start in (0, 13, 39):
        # The order within a top-k is not API.
        rows = oracle.topk[start:, :, ::-1].astype(np.uint8)
        verdict = check_rows(rows, start, oracle, margin=0.0)
        assert verdict.ok and verdict.near_ties == () and verdict.largest_near_tie_gap is None


def test_a_flip_at_the_closest_tie_is_a_near_tie_only_below_the_margin(
        model_dir: Path) -> None:
    oracle = oracle_rows(model_dir, _tokens(3, 40), TOP_K)
    position, layer = np.unravel_index(np.argmin(oracle.gap), oracle.gap.shape)
    gap = float(oracle.gap[position, layer])
    # Replace the k-th choice by the expert ranked k + 1 (what a near-tie flips to).
    logits_order = np.argsort(-_gate_output(model_dir, _tokens(3, 40), 0)[position, layer],
                              kind="stable")
    rows = oracle.topk.copy()
    kth = np.flatnonzero(rows[position, layer] == logits_order[TOP_K - 1])[0]
    rows[position, layer, kth] = logits_order[TOP_K]
    above = check_rows(rows, 0, oracle, margin=gap * 2 + 1e-6)
    assert above.ok and above.near_ties == (int(position),)
    assert above.largest_near_tie_gap == pytest.approx(gap)
    below = check_rows(rows, 0, oracle, margin=gap / 2)
    assert below.mismatches == (int(position),) and below.near_ties == ()
    assert below.mismatch_gaps == (pytest.approx(gap),)


@pytest.mark.parametrize("margin", [BF16_MARGIN, 10 * BF16_MARGIN])
def test_systematic_faults_fail_at_the_bf16_margin(model_dir: Path, margin: float) -> None:
    """Negative controls: another offset, another layer, another request. Neither
    the measured bf16 margin nor ten times it hides them."""
    tokens = _tokens(4, 48)
    oracle = oracle_rows(model_dir, tokens, TOP_K)
    rows = oracle.topk.astype(np.uint8)
    assert check_rows(rows, 0, oracle, margin).ok
    shifted = np.concatenate([rows[1:], rows[-1:]])
    assert len(check_rows(shifted, 0, oracle, margin).mismatches) > len(rows) // 3
    assert len(check_rows(rows[:-1], 1, oracle, margin).mismatches) > len(rows) // 3
    swapped = rows[:, ::-1, :]
    assert len(check_rows(swapped, 0, oracle, margin).mismatches) > len(rows) // 3
    other = oracle_rows(model_dir, _tokens(5, 48), TOP_K).topk.astype(np.uint8)
    assert len(check_rows(other, 0, oracle, margin).mismatches) > len(rows) // 3


def test_rows_that_do_not_fit_the_oracle_are_refused(model_dir: Path) -> None:
    oracle = oracle_rows(model_dir, _tokens(6, 10), TOP_K)
    with pytest.raises(ValueError, match=r"rows of shape \(11, 2, 2\) from position 0"):
        check_rows(np.zeros((11, LAYERS, TOP_K), np.uint8), 0, oracle, 0.0)
    with pytest.raises(ValueError, match="do not fit"):
        check_rows(np.zeros((5, LAYERS, 4), np.uint8), 0, oracle, 0.0)
