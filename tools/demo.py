#!/usr/bin/env python3
"""`make demo`: the fork serving a tiny MoE on CPU with routed experts on.

Builds a random-weight Qwen3-MoE locally (no hub), starts `vllm serve` with
`--enable-return-routed-experts` through the CPU opt-in
(VLLM_CPU_TRITON_INTERPRET=1), sends one greedy completion, prints its tokens
and routed-expert rows, and stops the server.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_server import VllmServer, cpu_env, decode_routed_experts  # noqa: E402
from tiny_moe import build, word  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to put the model and the server log (default: a temp dir)")
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=6)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-fork-demo-"))
    print(f"vllm {importlib.metadata.version('vllm')} (the fork, CPU base)")
    model = workdir / "tiny-moe"
    build(model, num_experts=8, num_experts_per_tok=2, seed=0)

    server = VllmServer(model=model, log_path=workdir / "serve.log",
                        extra_args=("--enable-return-routed-experts",),
                        env=cpu_env(opt_in=True, core=0))
    print(f"starting: VLLM_CPU_TRITON_INTERPRET=1 VLLM_USE_V2_MODEL_RUNNER=1 "
          f"{' '.join(server.command()[1:])}")
    start = time.monotonic()
    with server:
        print(f"server ready in {time.monotonic() - start:.0f} s (log: {server.log_path})")
        prompt = " ".join(word(4 + i) for i in range(args.prompt_len))
        body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0, "return_token_ids": True}
        response = server.complete(body)
    print("server stopped")

    choice = response["choices"][0]
    rows = decode_routed_experts(choice["routed_experts"])
    prompt_ids, completion_ids = choice["prompt_token_ids"], choice["token_ids"]
    print(f"prompt:     {prompt!r} ({len(prompt_ids)} tokens)")
    print(f"completion: {choice['text']!r} token ids {completion_ids}")
    print(f"routed_experts: shape {rows.shape} (prompt + completion - 1 = "
          f"{len(prompt_ids) + len(completion_ids) - 1} rows, layers, top_k), dtype {rows.dtype}")
    for position in range(min(4, len(rows))):
        layers = "  ".join(f"layer {i}: {list(map(int, r))}" for i, r in enumerate(rows[position]))
        print(f"  position {position}: {layers}")
    print(f"  ... {len(rows) - 4} more rows" if len(rows) > 4 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
