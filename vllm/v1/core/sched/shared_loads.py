# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Requests that carry the same KV hand-off load it once.

A request with ``n > 1`` whose prompt was prefilled elsewhere (P/D) reaches the
decode engine as ``n`` child requests that carry one KV hand-off, which the KV
connector names with ``KVConnectorBase_V1.shared_load_key``. Loaded one child at a
time, the remote side would be read ``n`` times, and it frees its blocks after the
first read: the later reads could land blocks it has since reused.

Contract (scheduler side; the KV connector and the workers see one load):

- The first member that starts an async load of the hand-off is its *leader*. The
  others (*siblings*) wait, holding no blocks, until that load has landed.
- When it lands, the scheduler pins the landed blocks (one reference) and each
  sibling *adopts* them by block id: the blocks below the prompt's last position
  are shared, the block holding that position is copied (the prefix cache's
  copy-on-write), so each member writes its own tokens into its own block.
- The pin is dropped once every registered sibling has adopted or finished, or
  once the landing is older than the KV lease (a sibling that never comes).
- Where blocks cannot be adopted by id (``shared_loads_supported``), a sibling
  never waits: it consumes the hand-off at once and computes its prompt.
- A hand-off's KV is the KV of one prompt. Only requests whose prompt equals the
  first member's (``HandoffPrompt``: the token ids and the block hashes, which
  also cover multimodal inputs, LoRA and the cache salt) share its load. A request
  that carries the same hand-off with another prompt (a router or a client that
  copied another request's ``kv_transfer_params``) never loads, waits for or
  adopts it: it consumes the hand-off without reading it and computes its prompt
  locally, and a warning names both requests.

Failure policy: a hand-off is read at most once, and its KV only ever serves the
prompt it was computed for. A member that comes after it was
consumed (the pin dropped, the leader finished before its load landed, the first
member loaded nothing) never loads it again: the connector consumes it without
reading or notifying the remote side, and the request computes its prompt
locally. A sibling that finishes before adopting never notifies the remote side,
unless it is the last member and none loaded (the remote side must still free).
The asserts below state invariants of this class's own transitions (a landing
exists in the ADOPT state; only the leader lands), which no request input reaches.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
)
from vllm.v1.request import Request

logger = init_logger(__name__)

Blocks = tuple[list[KVCacheBlock], ...]
# KV cache groups whose every block below a position stays valid while held.
_SHAREABLE_SPECS = (FullAttentionSpec, MLAAttentionSpec)


class SharedLoadState(enum.Enum):
    """What a waiting member of a shared load does this step."""

    LOAD = "load"
    """Not a member, or no member has started the load: look up as usual."""
    WAIT = "wait"
    """The leader's load is in flight: skip this step, holding nothing."""
    ADOPT = "adopt"
    """The load landed: adopt its blocks instead of loading."""
    CONSUMED = "consumed"
    """The hand-off was read: consume it without loading, compute locally."""


@dataclass(frozen=True)
class HandoffPrompt:
    """What a hand-off's KV was computed for: a request's prompt token ids and its
    full blocks' hashes (which chain in multimodal inputs, LoRA and the cache
    salt). A prompt given as embeddings has no token ids and shares nothing."""

    token_ids: tuple[int, ...] | None
    block_hashes: tuple[Hashable, ...]

    @classmethod
    def of(cls, request: Request) -> HandoffPrompt:
        token_ids = request.prompt_token_ids
        return cls(
            None if token_ids is None else tuple(token_ids),
            tuple(request.block_hashes),
        )

    def same_kv(self, other: HandoffPrompt) -> bool:
        return (
            self.token_ids is not None
            and self.token_ids == other.token_ids
            and self.block_hashes == other.block_hashes
        )


@dataclass
class Landing:
    """A leader's load that landed, pinned for its siblings."""

    blocks: Blocks
    """The landed blocks, per KV cache group, each holding one pin reference."""
    num_tokens: int
    """The prompt positions the load brought (a failed load: its valid prefix)."""
    rows_arrived: bool
    """Whether the load brought the routed-experts rows of those positions."""
    deadline: float


@dataclass
class SharedLoad:
    """One hand-off and the live requests that carry it."""

    prompt: HandoffPrompt
    """The first member's prompt: only requests with the same one are members."""
    members: set[str] = field(default_factory=set)
    """Members that have neither adopted the load nor finished (not the leader)."""
    leader: str | None = None
    landing: Landing | None = None


class SharedLoads:
    """The scheduler's record of hand-offs that several requests carry."""

    def __init__(self, lease_seconds: float, adopt: bool = True) -> None:
        self._lease_seconds = lease_seconds
        self._adopt = adopt
        self._loads: dict[Hashable, SharedLoad] = {}
        self._member_key: dict[str, Hashable] = {}
        # Hand-offs read (or given up), until their lease ran out on the remote
        # side: a request that comes with one never loads it.
        self._consumed: dict[Hashable, float] = {}
        # Requests that carry a live hand-off with another prompt than its
        # members': never members, they compute locally.
        self._foreign: set[str] = set()

    def add(self, request_id: str, key: Hashable | None, prompt: HandoffPrompt) -> None:
        """Register a new request that carries the hand-off ``key``."""
        if key is None:
            return
        self._member_key[request_id] = key
        if key in self._consumed:
            return
        load = self._loads.get(key)
        if load is None:
            self._loads[key] = SharedLoad(prompt, members={request_id})
        elif load.prompt.same_kv(prompt):
            load.members.add(request_id)
        else:
            self._foreign.add(request_id)
            logger.warning(
                "Request %s carries the KV hand-off %s of request %s with another "
                "prompt: it will not load or share that KV, and computes its "
                "prompt locally.",
                request_id,
                key,
                load.leader or next(iter(sorted(load.members)), "(finished)"),
            )

    def state(self, request_id: str) -> SharedLoadState:
        key = self._member_key.get(request_id)
        if key is None:
            return SharedLoadState.LOAD
        if request_id in self._foreign:
            return SharedLoadState.CONSUMED
        load = self._loads.get(key)
        if load is None:
            return SharedLoadState.CONSUMED
        if load.leader is None:
            return SharedLoadState.LOAD
        if not self._adopt:
            return SharedLoadState.CONSUMED
        if load.landing is None:
            return SharedLoadState.WAIT
        return SharedLoadState.ADOPT

    def landing(self, request_id: str) -> Landing:
        load = self._loads[self._member_key[request_id]]
        assert load.landing is not None
        return load.landing

    def started(self, request_id: str, load_kv_async: bool) -> None:
        """A member was admitted by the usual lookup: it leads the load when it
        loads asynchronously; otherwise the connector consumed the hand-off."""
        key = self._member_key.get(request_id)
        if key is None:
            return
        load = self._loads.get(key)
        if load is None or load.leader is not None or request_id in self._foreign:
            self._member_key.pop(request_id)
            self._foreign.discard(request_id)
            return
        load.members.discard(request_id)
        if load_kv_async:
            load.leader = request_id
        else:
            self._member_key.pop(request_id)
            self._dissolve(key)

    def land(
        self,
        request_id: str,
        blocks: Blocks,
        num_tokens: int,
        rows_arrived: bool,
        now: float | None = None,
    ) -> bool:
        """The leader's load landed on ``blocks``. Returns whether the scheduler
        must pin them: some sibling still waits to adopt them."""
        key = self._member_key.pop(request_id, None)
        if key is None:
            return False
        load = self._loads[key]
        assert load.leader == request_id
        if not load.members or num_tokens <= 0 or not self._adopt:
            self._dissolve(key)
            return False
        deadline = (time.monotonic() if now is None else now) + self._lease_seconds
        load.landing = Landing(
            tuple(list(group) for group in blocks), num_tokens, rows_arrived, deadline
        )
        return True

    def adopted(self, request_id: str) -> Blocks | None:
        """A sibling adopted the landing. Returns the blocks to unpin when it was
        the last sibling waiting."""
        return self._settle(request_id)

    def consumed(self, request_id: str) -> None:
        """A member gave up its consumed hand-off (it computes locally)."""
        self._member_key.pop(request_id, None)
        self._foreign.discard(request_id)

    def finished(self, request_id: str) -> tuple[Blocks | None, bool]:
        """A member finished. Returns the blocks to unpin, if any, and whether
        the request must not notify the remote side (another member reads, or
        read, the hand-off)."""
        key = self._member_key.get(request_id)
        if key is None:
            return None, False
        load = self._loads.get(key)
        if load is None or request_id in self._foreign:
            self._member_key.pop(request_id)
            self._foreign.discard(request_id)
            return None, True
        if load.leader == request_id:
            # The leader is gone before its load landed: nothing to adopt (its
            # blocks are freed once the read ends); its siblings compute.
            self._member_key.pop(request_id)
            self._dissolve(key)
            return None, False
        last_without_reader = load.leader is None and load.members == {request_id}
        return self._settle(request_id), not last_without_reader

    def expire(self, now: float | None = None) -> list[Blocks]:
        """Drop the pins older than the lease; forget consumed hand-offs whose
        lease ran out. Returns the blocks to unpin."""
        now = time.monotonic() if now is None else now
        unpin: list[Blocks] = []
        for key, load in list(self._loads.items()):
            if load.landing is not None and load.landing.deadline <= now:
                unpin.append(load.landing.blocks)
                self._dissolve(key)
        for key, until in list(self._consumed.items()):
            if until <= now:
                del self._consumed[key]
        return unpin

    def num_pins(self) -> int:
        return sum(load.landing is not None for load in self._loads.values())

    def _settle(self, request_id: str) -> Blocks | None:
        key = self._member_key.pop(request_id, None)
        load = self._loads.get(key) if key is not None else None
        if load is None:
            return None
        load.members.discard(request_id)
        if load.members or load.landing is None:
            return None
        self._dissolve(key)
        return load.landing.blocks

    def _dissolve(self, key: Hashable) -> None:
        self._loads.pop(key, None)
        self._consumed[key] = time.monotonic() + self._lease_seconds


def shared_loads_supported(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> bool:
    """Adopting blocks by id needs the prefix cache (it hands blocks in as a
    hit, copy-on-write for the last one) and full attention in every KV cache
    group, at one block size: a sliding window or a state group would need its
    own rules for which blocks a sibling may share."""
    groups = kv_cache_config.kv_cache_groups
    return (
        vllm_config.kv_transfer_config is not None
        and vllm_config.cache_config.enable_prefix_caching
        and len(groups) > 0
        and all(type(g.kv_cache_spec) in _SHAREABLE_SPECS for g in groups)
        and len({g.kv_cache_spec.block_size for g in groups}) == 1
    )


def adopted_prefix(
    landing: Landing, num_prompt_tokens: int, block_size: int
) -> tuple[Blocks, int]:
    """The blocks a sibling adopts and the positions they hold: the landed
    prompt up to (not including) its last position, which every member computes
    itself to sample its first token. A prefix that ends inside a block hands
    that block in too; the prefix cache copies it on allocation."""
    num_tokens = min(landing.num_tokens, num_prompt_tokens - 1)
    num_blocks = -(-num_tokens // block_size)
    return tuple(group[:num_blocks] for group in landing.blocks), num_tokens


def flat(blocks: Blocks) -> Sequence[KVCacheBlock]:
    return [block for group in blocks for block in group]
