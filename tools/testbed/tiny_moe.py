# SPDX-License-Identifier: Apache-2.0
"""Build a tiny random-weight Qwen3-MoE checkpoint plus a word-level tokenizer.

A test fixture (`from tools.testbed.tiny_moe import build`), also used by the harness
and the demo. Everything is created locally (no hub access), so the output
directory can be served by vLLM with ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``.

Example, from the repository root::

    python -m tools.testbed.tiny_moe /tmp/tiny-moe
    python -m tools.testbed.tiny_moe /tmp/tiny-moe-300 --num-experts 300  # uint16 ids
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

VOCAB_SIZE = 512
PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(len(SPECIAL_TOKENS))


def word(token_id: int) -> str:
    """Vocabulary word for a non-special token id (``w4`` .. ``w511``)."""
    return f"w{token_id}"


def build_config(num_experts: int, num_experts_per_tok: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # CPU attention rejects head_dim=16
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=True,
        # Every layer is sparse: no dense-MLP-only layers, sparse step 1.
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        architectures=["Qwen3MoeForCausalLM"],
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
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
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def build(out_dir: Path, num_experts: int, num_experts_per_tok: int, seed: int) -> None:
    torch.manual_seed(seed)
    config = build_config(num_experts, num_experts_per_tok)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"saved {out_dir}: {n_params} params, experts={num_experts}, "
        f"top_k={num_experts_per_tok}, layers={config.num_hidden_layers}, seed={seed}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="output model directory")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--num-experts-per-tok", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out_dir, args.num_experts, args.num_experts_per_tok, args.seed)


if __name__ == "__main__":
    main()
