# SPDX-License-Identifier: Apache-2.0
"""Bytes of one KV block and of its rows slot, for the served tiny model and the
production shapes: a library of the byte and cost benchmarks (rows_transfer_bytes,
offload_rows_cost, mooncake_store_rows_cost, mooncake_kv_put_latency,
routed_experts_opt_out), not a script.

Both sides come from the code that moves them: the rows slot from the fork's
`RowsFormat` (rows_transfer.py: block_size x layers x top_k x itemsize + the 32-byte
tag), the KV page from vLLM's own `FullAttentionSpec` / `MLAAttentionSpec`
(`page_size_bytes`, per attention layer, times the layers). The production figures
are tools/testbed/model_shapes.py's; the tiny model's are read from the checkpoint
the harness serves (tools/testbed/tiny_moe.py, served in float32 with 32-token
blocks).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.testbed import model_shapes
from tools.testbed.model_shapes import ModelShape
from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec


@dataclass(frozen=True)
class Shape:
    """A model as served: its routing and its KV blocks."""

    name: str
    layers: int  # all hidden layers: the capture has a row for dense ones too
    attention_layers: int
    top_k: int
    num_experts: int
    block_size: int
    kv_dtype: torch.dtype
    num_kv_heads: int = 0  # 0: MLA
    head_size: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim
    source: str = ""


def served(model: ModelShape) -> Shape:
    """`model` (one with its `attention`) as the benchmarks size it; a shape not
    checked against its config.json says so in its name."""
    attention = model.attention
    if attention is None:
        raise ValueError(f"{model.name}: no attention shape to size its KV by")
    return Shape(
        model.name + (" (assumed shape)" if model.assumed else ""),
        model.num_layers,
        attention.layers,
        model.top_k,
        model.num_experts,
        attention.block_size,
        getattr(torch, attention.dtype),
        num_kv_heads=attention.num_kv_heads,
        head_size=attention.head_size,
        source=attention.source,
    )


PRODUCTION: tuple[Shape, ...] = tuple(served(model) for model in model_shapes.PRODUCTION)


def tiny_shape() -> Shape:
    from tools.testbed.tiny_moe import build

    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp) / "tiny", num_experts=8, num_experts_per_tok=2, seed=0)
        config = json.loads((Path(tmp) / "tiny" / "config.json").read_text())
    return Shape("tiny Qwen3-MoE (served)", config["num_hidden_layers"],
                 config["num_hidden_layers"], config["num_experts_per_tok"],
                 config["num_local_experts"], 32, torch.float32,
                 num_kv_heads=config["num_key_value_heads"], head_size=config["head_dim"],
                 source="tools/testbed/tiny_moe.py checkpoint, float32, 32-token blocks")


def kv_bytes_per_block(shape: Shape) -> int:
    if shape.num_kv_heads:
        spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
                                 head_size=shape.head_size, dtype=shape.kv_dtype)
    else:
        spec = MLAAttentionSpec(block_size=shape.block_size, num_kv_heads=1,
                                head_size=shape.head_size, dtype=shape.kv_dtype)
    return spec.page_size_bytes * shape.attention_layers


def rows_format(shape: Shape) -> RowsFormat:
    """The fork's rows slot for `shape`: uint8 expert ids up to 256 experts, uint16 above."""
    dtype = "uint8" if shape.num_experts <= 256 else "uint16"
    return RowsFormat(shape.layers, shape.top_k, dtype, shape.block_size)


def rows_bytes_per_block(shape: Shape) -> int:
    return rows_format(shape).slot_nbytes
