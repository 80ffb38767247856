# SPDX-License-Identifier: Apache-2.0
"""Build a tiny random-weight Qwen3-MoE checkpoint plus a word-level tokenizer.

A test fixture (`from tools.testbed.tiny_moe import build`), also used by the harness
and the demo. Everything is created locally (no hub access), so the output
directory can be served by vLLM with ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``.

Example, from the repository root::

    python -m tools.testbed.tiny_moe /tmp/tiny-moe
    python -m tools.testbed.tiny_moe /tmp/tiny-moe-300 --num-experts 300  # uint16 ids
    python -m tools.testbed.tiny_moe /tmp/qwen3-shape --preset qwen3-30b-a3b

A preset (tools/testbed/model_shapes.py) gives the checkpoint a real model's
routing shape (its layer count, its leading dense layers, its expert count and
top-k), so its routed-experts rows have that model's size per token, while the
compute stays tiny (hidden size 64, expert size 16) and prompts up to
`max_model_len` tokens fit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tools.testbed.model_shapes import PRESETS, ModelShape

VOCAB_SIZE = 512
PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(len(SPECIAL_TOKENS))


def word(token_id: int) -> str:
    """Vocabulary word for a non-special token id (``w4`` .. ``w511``)."""
    return f"w{token_id}"


def build_config(
    num_experts: int,
    num_experts_per_tok: int,
    shape: ModelShape | None = None,
    max_model_len: int = 1024,
) -> Qwen3MoeConfig:
    """The tiny fixture's config (2 layers), or with `shape` a real model's
    routing shape at the smallest compute that serves."""
    if shape is None:
        layers, dense, experts, top_k = 2, 0, num_experts, num_experts_per_tok
        hidden, intermediate, expert, heads, kv_heads = 128, 256, 64, 4, 2
    else:
        layers, dense = shape.num_layers, shape.num_dense_layers
        experts, top_k = shape.num_experts, shape.top_k
        hidden, intermediate, expert, heads, kv_heads = 64, 128, 16, 2, 1
    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        moe_intermediate_size=expert,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,  # CPU attention rejects head_dim=16
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        # Sparse step 1: every layer routes, but the leading dense ones.
        decoder_sparse_step=1,
        mlp_only_layers=list(range(dense)),
        max_position_embeddings=max_model_len,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        architectures=["Qwen3MoeForCausalLM"],
    )


def build_tokenizer(max_model_len: int = 1024) -> PreTrainedTokenizerFast:
    """Whitespace-split word-level tokenizer: specials 0..3, then w4..w511."""
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=max_model_len,
        clean_up_tokenization_spaces=False,
    )


def build(
    out_dir: Path,
    num_experts: int,
    num_experts_per_tok: int,
    seed: int,
    preset: str | None = None,
    max_model_len: int | None = None,
) -> None:
    """Write the checkpoint. With `preset` (a key of PRESETS) its routing shape
    replaces the expert counts, and `max_model_len` defaults to 32,768."""
    shape = None
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(
                f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}"
            )
        shape = PRESETS[preset]
    length = max_model_len or (32768 if shape is not None else 1024)
    torch.manual_seed(seed)
    config = build_config(num_experts, num_experts_per_tok, shape, length)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    build_tokenizer(length).save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"saved {out_dir}: {n_params} params, experts={config.num_experts}, "
        f"top_k={config.num_experts_per_tok}, layers={config.num_hidden_layers} "
        f"({len(config.mlp_only_layers)} dense), max_model_len={length}, seed={seed}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="output model directory")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--num-experts-per-tok", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a real model's routing shape (overrides the expert counts)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion (default 1024; 32768 with --preset)",
    )
    args = parser.parse_args()
    build(
        args.out_dir,
        args.num_experts,
        args.num_experts_per_tok,
        args.seed,
        args.preset,
        args.max_model_len,
    )


if __name__ == "__main__":
    main()
