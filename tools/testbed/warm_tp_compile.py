# SPDX-License-Identifier: Apache-2.0
"""Warm Inductor's cache for upstream's TP embedding mask before a TP > 1 server starts.

With TP > 1, vLLM's `VocabParallelEmbedding.forward` calls
`get_masked_input_and_mask`, a function under `@torch.compile(dynamic=True)` with
Inductor on CPU. Its first call in a fresh cache compiles C++ (about 12 s on an idle
2-core VM, more than 300 s on one with eight busy processes, where it outlasted vLLM's
`execute_model` timeout and killed the engine: docs/deployment-shapes.md). This
module makes the same calls, for every rank's vocabulary shard, in a process of its
own with the Inductor settings vLLM's CPU worker sets, so that the servers' first
forward finds the compiled code in the shared cache. The harness runs it once per
process before it starts a deployment with a TP > 1 role.

    python -m tools.testbed.warm_tp_compile --vocab-size 512 --tp 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# What vLLM's CPU platform sets for its workers (vllm/platforms/cpu.py); part of the
# compiled code's identity, so the warm-up must compile with the same.
WORKER_INDUCTOR_ENV = {
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
    "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
}
# Token ids reach the embedding as int32 from Model Runner V2's input buffers; int64
# where another runner or path hands them over.
TOKEN_ID_DTYPES = ("int32", "int64")
# How many token ids a forward hands the mask. Dynamo specialises a size of 1 even
# under dynamic=True, so a one-token step (decode, or a prompt whose other tokens came
# with the KV) has a graph of its own; two other lengths give the dynamic-shape graph
# every longer step uses, never one specialised to a size. Without 1, a TP 2 decode's
# first step compiled C++ for minutes on a loaded 2-core VM despite the warm-up.
LENGTHS = (1, 5, 17)


def warm(vocab_size: int, tp: int, lengths: tuple[int, ...] = LENGTHS) -> float:
    """Compile the mask for each rank's shard of a `vocab_size` vocabulary split
    `tp` ways, for ids of each of `lengths`; returns the seconds it took."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size

    start = time.monotonic()
    padded = pad_vocab_size(vocab_size)
    # vLLM's workers run the forward under inference mode, part of the graph's key.
    with torch.inference_mode():
        _warm_shards(vocab_size, padded, tp, lengths)
    return time.monotonic() - start


def _warm_shards(vocab_size: int, padded: int, tp: int, lengths: tuple[int, ...]) -> None:
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        get_masked_input_and_mask,
    )

    for rank in range(tp):
        shard = VocabParallelEmbedding._get_indices(
            padded, padded, vocab_size, vocab_size, rank, tp
        )
        for dtype in TOKEN_ID_DTYPES:
            for length in lengths:
                ids = torch.arange(length, dtype=getattr(torch, dtype)) % vocab_size
                get_masked_input_and_mask(
                    ids,
                    shard.org_vocab_start_index,
                    shard.org_vocab_end_index,
                    shard.num_org_vocab_padding,
                    shard.added_vocab_start_index,
                    shard.added_vocab_end_index,
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.testbed.warm_tp_compile", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="the served model's vocab_size (config.json)")
    parser.add_argument("--tp", type=int, required=True,
                        help="the server's --tensor-parallel-size (> 1)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        metavar="N", help="token counts to compile for (default: "
                        f"{' '.join(map(str, LENGTHS))}: 1 has a graph of its own)")
    args = parser.parse_args(argv)
    if args.tp < 2:
        parser.error(f"--tp {args.tp}: the mask is compiled only with TP > 1; pass 2 or more")
    missing = {k: v for k, v in WORKER_INDUCTOR_ENV.items() if os.environ.get(k) != v}
    if missing:
        parser.error(f"run with the worker's Inductor settings in the environment: {missing}")
    if min(args.lengths) < 1:
        parser.error(f"--lengths {args.lengths}: each is a token count, 1 or more")
    seconds = warm(args.vocab_size, args.tp, tuple(args.lengths))
    print(f"warm_tp_compile: TP {args.tp} embedding mask compiled in {seconds:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
