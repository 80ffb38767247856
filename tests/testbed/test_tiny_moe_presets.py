"""The tiny builder's routing-shape presets (tools/testbed/tiny_moe.py): each
checkpoint has its model's routing shape, read back from the written config, and
its rows' size per token equals the published figure. Expected values are typed
in from the model cards and the design notes, not taken from the presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.testbed.tiny_moe import PRESETS, build

# (layers, leading dense layers, experts, top-k, row bytes per token): Qwen3-30B-A3B
# 48 x 8 uint8 = 384 B (prime-rl's figure); GLM-5 78 x 8 = 624 B
# (rows-travel-with-kv.md); DeepSeek-V3 61 layers (first_k_dense_replace 3) x 8 =
# 488 B; more than 256 experts need uint16: 8 x 8 x 2 = 128 B.
EXPECTED = {
    "qwen3-30b-a3b": (48, 0, 128, 8, 384),
    "glm-5": (78, 3, 256, 8, 624),
    "deepseek-v3": (61, 3, 256, 8, 488),
    "wide-512": (8, 0, 512, 8, 128),
}


def test_every_preset_is_checked() -> None:
    assert set(PRESETS) == set(EXPECTED)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_the_checkpoint_has_the_models_routing_shape(preset: str, tmp_path: Path) -> None:
    layers, dense, experts, top_k, row_bytes = EXPECTED[preset]
    build(tmp_path / preset, num_experts=8, num_experts_per_tok=2, seed=0, preset=preset)
    config = json.loads((tmp_path / preset / "config.json").read_text())
    tokenizer = json.loads((tmp_path / preset / "tokenizer_config.json").read_text())
    assert config["num_hidden_layers"] == layers
    assert config["mlp_only_layers"] == list(range(dense))
    assert config["num_experts_per_tok"] == top_k
    # transformers writes Qwen3-MoE's expert count as num_local_experts.
    assert config.get("num_local_experts", config.get("num_experts")) == experts
    # The compute stays tiny, and 32k-token prompts fit.
    assert config["hidden_size"] == 64 and config["moe_intermediate_size"] == 16
    assert config["max_position_embeddings"] == 32768
    assert tokenizer["model_max_length"] == 32768
    assert PRESETS[preset].row_bytes_per_token == row_bytes


def test_an_unknown_preset_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'qwen3'.*qwen3-30b-a3b"):
        build(tmp_path / "x", num_experts=8, num_experts_per_tok=2, seed=0, preset="qwen3")
    assert not (tmp_path / "x").exists()


def test_without_a_preset_the_served_fixture_is_unchanged(tmp_path: Path) -> None:
    """Negative control: the default checkpoint keeps the fixture's shape."""
    build(tmp_path / "tiny", num_experts=8, num_experts_per_tok=2, seed=0)
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 128)
    assert config["max_position_embeddings"] == 1024
