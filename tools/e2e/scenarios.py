"""The equivalence harness's scenarios: what each one sends and what it must show.

Prompts are token-id lists (ids 4..511 of the tiny model's vocabulary), made
from a per-scenario seed so every run sends the same requests. The servers use
a 32-token KV block, so a prompt of length P starts the decode forward at P - 1,
on a block boundary when (P - 1) % 32 == 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

BLOCK_SIZE = 32


@dataclass(frozen=True)
class Req:
    prompt_len: int
    max_tokens: int = 6
    prompt_start: int | str = 0  # an int, or "prev" (multi-turn: previous P + C - 1)


@dataclass(frozen=True)
class Scenario:
    name: str
    # which deployment it needs: "base", "preempt", "e300", "offload-colocated",
    # "offload-pd" or "mooncake-pd"
    group: str
    requests: tuple[Req, ...]
    concurrency: int = 1
    turns: int = 1  # > 1: each request opens a conversation; turn k+1 = prompt + completion
    # Turn-major order (every conversation's turn 1, then every turn 2, ...), one request
    # at a time: later turns find their blocks evicted by the other conversations, and a
    # run loads the same tokens every time.
    interleave: bool = False
    min_preemptions: int = 0
    min_loaded_tokens: int = 0  # KV-offload scenarios must load something to prove anything
    # False: the deployment's twin (routed experts off) gets none of this traffic, as
    # its loads would say nothing (the subject loads what only decode computed).
    twin: bool = True
    expect_dtype: str = "uint8"
    seed: int = 0
    # Turn k+1 sends turn k's prompt again (not prompt + completion): decode finds the
    # whole prompt in its own prefix cache.
    resend: bool = False
    # Tokens decode must take from its local prefix cache (vllm:prefix_cache_hits):
    # a reuse scenario that reused nothing proves nothing.
    min_decode_hit_tokens: int = 0
    # Prefill instances that must have served part of the traffic (xPyD).
    min_prefills_used: int = 0
    # Each conversation's turn 1 is streamed and hung up after its first chunk (an RL
    # rollout aborted while its chunks are being stored); it is not compared. Once the
    # scenario's requests are done, the servers they ran on must hold no KV blocks.
    abort_first: bool = False


def prompt_ids(seed: int, index: int, length: int) -> list[int]:
    rng = random.Random(seed * 1000 + index)
    return [rng.randrange(4, 512) for _ in range(length)]


# KV offload. Three conversations of 3-5 blocks each beside an 8-block KV cache: by the
# time a conversation's next turn comes, the others have evicted its blocks.
# Multi-turn RL asks for rows from the previous prompt + completion - 1 on (the spec's
# convention), so everything before may load; replaying a whole conversation asks for
# rows from 0, so nothing may load and the twin's loads are what the limit withheld.
MULTI_TURN = tuple(Req(n, max_tokens=6, prompt_start="prev") for n in (96, 112, 128))
ROWS_FROM_0 = tuple(Req(n, max_tokens=6, prompt_start=0) for n in (100, 120, 136))

# Prompts one token past a block boundary and 40-token completions: turn 1 fills block 2
# (positions 64..95) on decode only.
DECODE_KV = (Req(65, max_tokens=40, prompt_start="prev"),)


# Prompts of 3-4 blocks with long completions, each aborted after its first token.
ABORT_MID_STORE = (Req(100, max_tokens=24, prompt_start=0),
                   Req(136, max_tokens=24, prompt_start=0))


def offload_pair(prefix: str, group: str, seed: int, turns: int = 3) -> tuple[Scenario, ...]:
    """A deployment's two offload workloads: multi-turn (must load) and rows from 0."""
    return (Scenario(f"{prefix}-multi-turn", group, MULTI_TURN, turns=turns, interleave=True,
                     min_loaded_tokens=1, seed=seed),
            Scenario(f"{prefix}-rows-from-0", group, ROWS_FROM_0, turns=turns,
                     interleave=True, seed=seed + 100))


# Turn 2 asks for every row of a 49-token prompt whose block 0 decode holds from turn 1:
# rows [0, 32) from decode's own prefix cache (with rows that travel with the KV: the
# rows turn 1 imported), [32, 48) pulled from prefill, [48, 49) computed by decode.
THREE_SOURCE = Scenario("three-source-rows", "base", (Req(33, max_tokens=16, prompt_start=0),),
                        turns=2, min_decode_hit_tokens=BLOCK_SIZE, seed=16)

FULL: tuple[Scenario, ...] = (
    Scenario("first-forward-on-block-boundary", "base",
             (Req(33), Req(65, max_tokens=8), Req(97)), seed=1),
    Scenario("first-forward-mid-block", "base",
             (Req(5), Req(20), Req(32), Req(34), Req(50, max_tokens=10)), seed=2),
    Scenario("prompt-start-mid-prompt", "base",
             (Req(30, prompt_start=13), Req(40, prompt_start=32), Req(21, prompt_start=20)), seed=3),
    Scenario("prompt-start-equals-prompt-length", "base",
             (Req(21, prompt_start=21), Req(33, prompt_start=33)), seed=4),
    Scenario("concurrency-4", "base",
             tuple(Req(8 + 7 * i, max_tokens=5 + i % 3) for i in range(8)), concurrency=4, seed=5),
    Scenario("multi-turn", "base",
             (Req(12, max_tokens=5), Req(19, max_tokens=6, prompt_start="prev")), turns=3, seed=6),
    Scenario("decode-preemption", "preempt",
             tuple(Req(26 + 3 * i, max_tokens=28) for i in range(6)), concurrency=4,
             min_preemptions=1, seed=7),
    THREE_SOURCE,
    # The same 97-token prompt twice: decode holds blocks 0-2 from the first time, so
    # the second time every prompt row but the last comes from decode's prefix cache.
    Scenario("decode-local-reuse", "base", (Req(97, max_tokens=4),), turns=2, resend=True,
             min_decode_hit_tokens=3 * BLOCK_SIZE, seed=17),
    # xPyD: two prefill instances feed one decode; decode reads KV and rows from both.
    Scenario("two-prefill-instances", "xpyd",
             tuple(Req(20 + 9 * i, max_tokens=5, prompt_start=(0, 7, 33)[i % 3])
                   for i in range(8)),
             concurrency=2, min_prefills_used=2, seed=18),
    Scenario("uint16-rows-300-experts", "e300",
             (Req(9), Req(17), Req(26, prompt_start=5)), expect_dtype="uint16", seed=8),
    *offload_pair("offload-colocated", "offload-colocated", 9),
    *offload_pair("offload-on-prefill", "offload-pd", 10),
    *offload_pair("mooncake-pd", "mooncake-pd", 13),
    # Completions long enough to fill a block on decode: the next turn's prefill can
    # only get that block from what decode saved to the store (save_decode_cache).
    # One conversation fits prefill's KV cache, so its own blocks stay local and
    # what it loads is decode's: block 2 in turn 2, block 3 in turn 3.
    Scenario("mooncake-pd-decode-kv", "mooncake-pd", DECODE_KV, turns=3,
             min_loaded_tokens=2 * BLOCK_SIZE, twin=False, seed=15),
    # The same with every row asked for: the blocks prefill loads from what decode
    # stored hold positions whose rows it returns, so they load only with their rows
    # objects (--routed-experts-transfer; without it nothing loads, so no minimum here:
    # tests/v1/kv_connector/test_mooncake_store_rows_e2e.py asserts the loads).
    Scenario("mooncake-pd-decode-kv-rows-from-0", "mooncake-pd",
             (Req(65, max_tokens=40, prompt_start=0),), turns=3, twin=False, seed=19),
    # Rollouts abort often: each prompt is first sent and hung up on after its first
    # token, while its chunks are being stored, then sent again and checked; no KV
    # block may stay held once they are done (vllm:kv_cache_usage_perc back to 0).
    *(Scenario(f"{prefix}-abort-mid-store", group, ABORT_MID_STORE, turns=2,
               resend=True, abort_first=True, twin=False, seed=seed)
      for prefix, group, seed in (("offload-colocated", "offload-colocated", 20),
                                  ("offload-on-prefill", "offload-pd", 21),
                                  ("mooncake-pd", "mooncake-pd", 22))),
)

REDUCED: tuple[Scenario, ...] = (
    Scenario("first-forward-on-block-boundary", "base", (Req(33),), seed=1),
    Scenario("first-forward-mid-block", "base", (Req(5), Req(20)), seed=2),
    Scenario("prompt-start-mid-prompt", "base", (Req(30, prompt_start=13),), seed=3),
    Scenario("multi-turn", "base", (Req(12, max_tokens=4, prompt_start="prev"),), turns=2, seed=6),
    THREE_SOURCE,
    *offload_pair("offload-colocated", "offload-colocated", 9, turns=2),
)

# Not in FULL: prompts far longer than a CPU run's 512-token context, for a GPU run
# that must reach beyond HiSparse's device buffer (one top-k plus slack per request;
# 4096 rows for an index_topk of 2048). Name them with --only; serve with a larger
# --max-model-len (docs/deployments/hisparse-decode.md).
LONG_CONTEXT: tuple[Scenario, ...] = (
    Scenario("long-context", "base",
             (Req(6000, max_tokens=64), Req(9000, max_tokens=64, prompt_start=4000),
              Req(7000, max_tokens=32, prompt_start="prev")), turns=2, seed=21),
)
