# SPDX-License-Identifier: Apache-2.0
"""The shapes of real models that the tiny fixture and the benchmarks stand in for:
the one place their figures are written.

- `PRESETS`: the routing shapes `tools.testbed.tiny_moe --preset` builds (a real
  model's layers, dense layers, experts and top-k, at tiny compute);
- `PRODUCTION`: the shapes whose KV the byte and cost benchmarks size
  (benchmarks/block_bytes.py), each with its `Attention`.

Here, not in benchmarks/, because tools/testbed builds from it and must not import
benchmarks (tools/__init__.py). Each figure's source is in its `source`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Attention:
    """The KV a model's attention layers keep, as the benchmarks size it."""

    layers: int  # attention layers (every decoder layer in these models)
    num_kv_heads: int  # 0: MLA, one latent per token
    head_size: int  # MLA: kv_lora_rank + qk_rope_head_dim
    dtype: str  # a torch dtype's name: the KV cache's
    block_size: int  # tokens per KV block in the benchmarks' figures
    source: str


@dataclass(frozen=True)
class ModelShape:
    """What a model's routed-experts rows look like: vLLM captures one row of
    ``top_k`` expert ids per token and decoder layer (dense layers included), in
    uint8 up to 256 experts and uint16 above."""

    name: str
    num_layers: int
    num_dense_layers: int  # leading layers with a dense MLP, no router
    num_experts: int
    top_k: int
    source: str
    assumed: bool = False  # not checked against the model's config.json
    attention: Attention | None = None

    @property
    def row_bytes_per_token(self) -> int:
        return self.num_layers * self.top_k * (1 if self.num_experts <= 256 else 2)


# Routing shapes of real models, from their published configs (the field names
# in `source` are the configs' own).
QWEN3_30B_A3B = ModelShape(
    name="Qwen3-30B-A3B",
    num_layers=48,
    num_dense_layers=0,
    num_experts=128,
    top_k=8,
    source="config.json: num_hidden_layers 48, num_experts 128, "
    "num_experts_per_tok 8, mlp_only_layers []",
    # config.json: GQA, 4 KV heads x 128, bf16.
    attention=Attention(
        layers=48,
        num_kv_heads=4,
        head_size=128,
        dtype="bfloat16",
        block_size=16,
        source="config.json as published (48 layers, 4 KV heads x 128)",
    ),
)
GLM_5 = ModelShape(
    name="GLM-5",
    num_layers=78,
    num_dense_layers=3,
    num_experts=256,
    top_k=8,
    source="design notes (rows-travel-with-kv.md): 78 layers, 3 dense + 75 "
    "MoE, 256 routed experts, top-8; not checked against a config.json",
    assumed=True,
    # DeepSeek-V3.2-style MLA: kv_lora_rank 512 + rope 64, 64-token blocks; the
    # design notes' shape, not checked against a config.json (no hub access).
    attention=Attention(
        layers=78,
        num_kv_heads=0,
        head_size=576,
        dtype="bfloat16",
        block_size=64,
        source="design notes: L=78, K=8, 256 experts, MLA 512+64; unverified",
    ),
)
DEEPSEEK_V3 = ModelShape(
    name="DeepSeek-V3",
    num_layers=61,
    num_dense_layers=3,
    num_experts=256,
    top_k=8,
    source="config.json: num_hidden_layers 61, first_k_dense_replace 3 "
    "(58 MoE layers), n_routed_experts 256, num_experts_per_tok 8",
)
WIDE_512 = ModelShape(
    name="512 experts (uint16 rows)",
    num_layers=8,
    num_dense_layers=0,
    num_experts=512,
    top_k=8,
    source="synthetic: more than 256 experts, so expert ids need uint16",
)

PRESETS: dict[str, ModelShape] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "glm-5": GLM_5,
    "deepseek-v3": DEEPSEEK_V3,
    "wide-512": WIDE_512,
}

# The shapes the byte and cost benchmarks size, in their table order.
PRODUCTION: tuple[ModelShape, ...] = (QWEN3_30B_A3B, GLM_5)
