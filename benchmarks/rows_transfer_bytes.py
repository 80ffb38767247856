#!/usr/bin/env python3
"""Bytes moved per KV block with routed-experts rows that travel with the KV:
rows (+ tag) / KV, per block, for the served tiny model and for the shapes of
two production models.

    .venv/bin/python -m benchmarks.rows_transfer_bytes

Both sides come from the code that moves them: the rows slot from the fork's
`RowsFormat` (rows_transfer.py: block_size x layers x top_k x itemsize + the
32-byte tag), the KV page from vLLM's own `FullAttentionSpec` / `MLAAttentionSpec`
(`page_size_bytes`, per attention layer, times the layers). The tiny model's shape
is read from the checkpoint the harness serves (tests/v1/tiny_moe.py, served in
float32 with 32-token blocks); the production shapes are written out below with
their sources and assumptions. A NIXL request moves one slot per pulled block on
TP rank 0 and the KV of every layer, so the ratio is the transfer's overhead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.distributed.aux_output_connector.rows_transfer import RowsFormat
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec


@dataclass(frozen=True)
class Shape:
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


PRODUCTION = (
    # Qwen3-30B-A3B config.json: 48 layers, 8 of 128 experts, GQA 4 KV heads x 128, bf16.
    Shape("Qwen3-30B-A3B", 48, 48, 8, 128, 16, torch.bfloat16, num_kv_heads=4,
          head_size=128, source="config.json as published (48 layers, 4 KV heads x 128)"),
    # GLM-5 (DeepSeek-V3.2-style MLA): 78 layers (3 dense), 8 of 256 routed experts,
    # kv_lora_rank 512 + rope 64, 64-token blocks; the design notes' shape, not
    # checked against a config.json here (no hub access).
    Shape("GLM-5 (assumed shape)", 78, 78, 8, 256, 64, torch.bfloat16,
          head_size=576, source="design notes: L=78, K=8, 256 experts, MLA 512+64; unverified"),
)


def tiny_shape() -> Shape:
    from tests.v1.tiny_moe import build

    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp) / "tiny", num_experts=8, num_experts_per_tok=2, seed=0)
        config = json.loads((Path(tmp) / "tiny" / "config.json").read_text())
    return Shape("tiny Qwen3-MoE (served)", config["num_hidden_layers"],
                 config["num_hidden_layers"], config["num_experts_per_tok"],
                 config["num_local_experts"], 32, torch.float32,
                 num_kv_heads=config["num_key_value_heads"], head_size=config["head_dim"],
                 source="tests/v1/tiny_moe.py checkpoint, float32, 32-token blocks")


def kv_bytes_per_block(shape: Shape) -> int:
    if shape.num_kv_heads:
        spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
                                 head_size=shape.head_size, dtype=shape.kv_dtype)
    else:
        spec = MLAAttentionSpec(block_size=shape.block_size, num_kv_heads=1,
                                head_size=shape.head_size, dtype=shape.kv_dtype)
    return spec.page_size_bytes * shape.attention_layers


def rows_bytes_per_block(shape: Shape) -> int:
    dtype = "uint8" if shape.num_experts <= 256 else "uint16"
    return RowsFormat(shape.layers, shape.top_k, dtype, shape.block_size).slot_nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    print(f"{'model':26} {'block':>5} {'rows+tag B':>10} {'KV B':>12} {'rows/KV':>8}  source")
    for shape in (tiny_shape(), *PRODUCTION):
        rows, kv = rows_bytes_per_block(shape), kv_bytes_per_block(shape)
        print(f"{shape.name:26} {shape.block_size:5d} {rows:10d} {kv:12d} "
              f"{rows / kv:8.2%}  {shape.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
