"""An independent reference for routed-experts rows: the router top-k that
transformers computes, in float32, on the tokens a server answered with.

A server in bf16, or with another tensor-parallel size, sums partial products in
another order than this oracle, so where a layer's k-th and (k + 1)-th router logits
nearly tie, it may pick the other expert. `check_rows` therefore counts a position as
a mismatch only where its expert set differs in a layer whose gap between those two
logits is at least `margin`; smaller gaps are near-ties, counted apart. A systematic
fault (rows of another offset, layer or request) differs at gaps far above any margin
that numerics explain, so it still fails (tests/v1/e2e/test_router_oracle.py plants
them).

Row i of a response is the routing of the token at absolute position
`routed_experts_start + i`; the oracle runs one forward over the prompt and every
completion token but the last (which was never forwarded).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# The margin for bf16 serving, measured (docs/deployment-shapes.md): served in bf16
# through P/D with decode TP = 2, 3 of 226 returned rows differed from this float32
# oracle, each in one layer whose top-k gap was 0.00031, 0.00113 or 0.00114. 0.002
# sits above them; on the tiny test model 2.3 % of (position, layer) gaps fall below
# it, so a systematic fault still differs at nearly every position.
BF16_MARGIN = 0.002


@dataclass(frozen=True)
class OracleRows:
    """The oracle's routing of every position of one token sequence."""

    topk: np.ndarray  # (positions, layers, top_k) expert ids
    # (positions, layers): the k-th largest router logit minus the (k + 1)-th
    gap: np.ndarray


@dataclass(frozen=True)
class RowsVerdict:
    """How a response's rows compare with the oracle's (absolute positions)."""

    mismatches: tuple[int, ...]  # an expert set differs where the gap >= margin
    # The smallest gap among each mismatch's differing layers (as many as mismatches).
    mismatch_gaps: tuple[float, ...]
    near_ties: tuple[int, ...]  # they differ only in layers whose gap < margin
    # The largest gap among the layers that differ only by a near-tie (None: none).
    largest_near_tie_gap: float | None

    @property
    def ok(self) -> bool:
        return not self.mismatches


@functools.lru_cache(maxsize=4)
def _model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def oracle_rows(model_dir: Path, token_ids: list[int], top_k: int) -> OracleRows:
    """The routing of every position of `token_ids`, from each MoE layer's router
    logits (the gate's first output)."""
    model = _model(str(model_dir))
    logits: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out: logits.append(out[0].detach().float().clone())
        )
        for layer in model.model.layers
    ]
    try:
        model(input_ids=torch.tensor([token_ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    stacked = torch.stack(logits, dim=1)  # (positions, layers, experts)
    ordered, ids = torch.sort(stacked, dim=-1, descending=True, stable=True)
    gap = ordered[..., top_k - 1] - ordered[..., top_k]
    return OracleRows(topk=ids[..., :top_k].numpy(), gap=gap.numpy())


def check_rows(
    rows: np.ndarray, start: int, oracle: OracleRows, margin: float
) -> RowsVerdict:
    """Compare `rows` (positions [start, start + len(rows))) with the oracle. The
    order within a top-k is not API: expert sets are compared."""
    end = start + len(rows)
    if (
        rows.ndim != 3
        or start < 0
        or end > len(oracle.topk)
        or (rows.shape[1:] != oracle.topk.shape[1:])
    ):
        raise ValueError(
            f"rows of shape {rows.shape} from position {start} do not fit "
            f"the oracle's {oracle.topk.shape}"
        )
    got = np.sort(rows.astype(np.int64), axis=-1)
    want = np.sort(oracle.topk[start:end].astype(np.int64), axis=-1)
    differs = (got != want).any(axis=-1)  # (positions, layers)
    gap = oracle.gap[start:end]
    real = (differs & (gap >= margin)).any(axis=1)
    tied = differs.any(axis=1) & ~real
    tie_gaps = gap[differs & (gap < margin)]
    real_gaps = np.where(differs & (gap >= margin), gap, np.inf).min(axis=1)
    return RowsVerdict(
        mismatches=tuple(start + int(i) for i in np.flatnonzero(real)),
        mismatch_gaps=tuple(float(g) for g in real_gaps[real]),
        near_ties=tuple(start + int(i) for i in np.flatnonzero(tied)),
        largest_near_tie_gap=float(tie_gaps.max()) if tie_gaps.size else None,
    )
