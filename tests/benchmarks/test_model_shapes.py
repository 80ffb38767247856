"""The model shapes (tools/testbed/model_shapes.py) hold the figures that
tools/testbed/tiny_moe.py's PRESETS and benchmarks/rows_transfer_bytes.py's
PRODUCTION each wrote out before they were one module. The expected values below are
those literals, typed in again, not read from the module."""

from __future__ import annotations

import pytest
import torch

from benchmarks import block_bytes
from tools.testbed import model_shapes, tiny_moe

# tiny_moe.py's PRESETS: name, layers, dense layers, experts, top-k, source.
PRESETS = {
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", 48, 0, 128, 8,
                      "config.json: num_hidden_layers 48, num_experts 128, "
                      "num_experts_per_tok 8, mlp_only_layers []"),
    "glm-5": ("GLM-5", 78, 3, 256, 8,
              "design notes (rows-travel-with-kv.md): 78 layers, 3 dense + 75 "
              "MoE, 256 routed experts, top-8; not checked against a config.json"),
    "deepseek-v3": ("DeepSeek-V3", 61, 3, 256, 8,
                    "config.json: num_hidden_layers 61, first_k_dense_replace 3 "
                    "(58 MoE layers), n_routed_experts 256, num_experts_per_tok 8"),
    "wide-512": ("512 experts (uint16 rows)", 8, 0, 512, 8,
                 "synthetic: more than 256 experts, so expert ids need uint16"),
}

# rows_transfer_bytes.py's PRODUCTION, as its Shape(...) calls wrote them.
PRODUCTION = (
    block_bytes.Shape("Qwen3-30B-A3B", 48, 48, 8, 128, 16, torch.bfloat16, num_kv_heads=4,
                      head_size=128,
                      source="config.json as published (48 layers, 4 KV heads x 128)"),
    block_bytes.Shape("GLM-5 (assumed shape)", 78, 78, 8, 256, 64, torch.bfloat16,
                      head_size=576,
                      source="design notes: L=78, K=8, 256 experts, MLA 512+64; unverified"),
)


def test_the_presets_are_the_literals_they_were() -> None:
    got = {key: (s.name, s.num_layers, s.num_dense_layers, s.num_experts, s.top_k, s.source)
           for key, s in model_shapes.PRESETS.items()}
    assert got == PRESETS
    assert list(model_shapes.PRESETS) == list(PRESETS)  # --preset's error lists them


def test_the_fixture_builds_from_the_same_presets() -> None:
    assert tiny_moe.PRESETS is model_shapes.PRESETS


def test_the_production_shapes_are_the_literals_they_were() -> None:
    assert block_bytes.PRODUCTION == PRODUCTION


def test_a_production_shape_is_a_preset_with_its_kv() -> None:
    """Routing figures are written once: the benchmarks' shapes are the presets'."""
    for model, shape in zip(model_shapes.PRODUCTION, block_bytes.PRODUCTION, strict=True):
        assert model in model_shapes.PRESETS.values()
        assert (shape.layers, shape.top_k, shape.num_experts) == (
            model.num_layers, model.top_k, model.num_experts)


def test_rows_bytes_and_kv_bytes_per_block_are_unchanged() -> None:
    """The figures benchmarks/README.md reports (rows_transfer_bytes.py)."""
    qwen3, glm5 = block_bytes.PRODUCTION
    assert (block_bytes.rows_bytes_per_block(qwen3), block_bytes.kv_bytes_per_block(qwen3)) \
        == (6_176, 1_572_864)
    assert (block_bytes.rows_bytes_per_block(glm5), block_bytes.kv_bytes_per_block(glm5)) \
        == (39_968, 5_750_784)


def test_a_shape_without_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="DeepSeek-V3: no attention shape"):
        block_bytes.served(model_shapes.DEEPSEEK_V3)
