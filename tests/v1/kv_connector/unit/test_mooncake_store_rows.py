"""Routed-experts rows objects beside the Mooncake store's KV chunks (patch
`store-routed-experts-rows-beside-mooncake-store`).

The store is a fake that does what Mooncake's batch calls do with registered
memory: a put copies each value's bytes from its address, a get copies them back to
the destination address, and each returns a per-key code (negative on failure). The
rows slots it moves are real host memory, so the round trip checks the addresses and
sizes too. Expected values come from the spec, not the code: token chains are derived
here with hashlib from the rule in rows_transfer.py's docstring, rows name their block
and position, and keys are written out from the key format in data.py. Each failure
mode has its own planted fault (an object never stored, a flipped byte, rows of other
tokens, a failed get, another rows format), and the positive case shows the check
passes on the bytes it guards.
"""

from __future__ import annotations

import ctypes
import inspect
import threading
import time
from unittest.mock import MagicMock

import numpy as np
import pytest

from tests.rows_spec import RowsByHash, spec_chains
from tests.rows_spec import rows_of_block as spec_rows_of_block
from vllm.distributed.aux_output_connector.rows_transfer import (
    RowsFormat,
    RowsMirror,
    SlotCheck,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.rows import (
    ChunkRowsPut,
    RejectedRowsKeys,
    StoreRowsJob,
    StoreRowsPutter,
    StoreRowsSlots,
    chunk_rows_puts,
    first_chunk_needing_rows,
    rows_key_prefix,
    store_rows_layout_problem,
)

BS = 4
FMT = RowsFormat(num_layers=2, top_k=2, dtype="uint8", block_size=BS)
TOKENS = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]  # 3 full blocks
HASHES = [bytes([index + 1]) * 32 for index in range(3)]
NUM_BLOCKS = 8


CHAINS = spec_chains(TOKENS, BS)


def rows_of_block(index: int) -> np.ndarray:
    return spec_rows_of_block(index, BS)


def all_rows() -> RowsByHash:
    return RowsByHash({h: rows_of_block(i) for i, h in enumerate(HASHES)})


class FakeStore:
    """Mooncake's batch calls over registered host memory."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.registered: list[tuple[int, int]] = []
        self.fail_gets: set[str] = set()

    def register_buffer(self, addr: int, size: int) -> int:
        self.registered.append((addr, size))
        return 0

    def _check_registered(self, addr: int, size: int) -> None:
        assert any(
            base <= addr and addr + size <= base + length
            for base, length in self.registered
        ), f"{size} B at {addr:#x} is outside every registered buffer"

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if key in self.objects else 0 for key in keys]

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        addrs: list[list[int]],
        sizes: list[list[int]],
        config: object = None,
    ) -> list[int]:
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            value = b""
            for addr, size in zip(key_addrs, key_sizes, strict=True):
                self._check_registered(addr, size)
                value += ctypes.string_at(addr, size)
            self.objects[key] = value
        return [0] * len(keys)

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        codes = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            value = self.objects.get(key)
            if value is None or key in self.fail_gets:
                codes.append(-704)  # OBJECT_NOT_FOUND
                continue
            assert len(value) == sum(key_sizes), "the value does not fit its buffer"
            offset = 0
            for addr, size in zip(key_addrs, key_sizes, strict=True):
                self._check_registered(addr, size)
                ctypes.memmove(addr, value[offset : offset + size], size)
                offset += size
            codes.append(len(value))
        return codes


def metadata(**changes: object) -> KeyMetadata:
    fields: dict = dict(
        model_name="tiny-moe", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0
    )
    fields.update(changes)
    return KeyMetadata(**fields)


def make_slots(
    fmt: RowsFormat = FMT, mirror: RowsMirror | None = None
) -> tuple[StoreRowsSlots, RowsMirror, FakeStore]:
    mirror = mirror or RowsMirror(fmt, NUM_BLOCKS)
    slots = StoreRowsSlots(fmt, NUM_BLOCKS, mirror, rows_key_prefix(metadata(), fmt))
    store = FakeStore()
    slots.register(store)
    return slots, mirror, store


def make_putter(
    slots: StoreRowsSlots,
    store: FakeStore,
    reader: RowsByHash,
    capacity: int = 8,
) -> StoreRowsPutter:
    """A putter whose rounds the test runs itself (its thread is never started)."""

    def put(keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list:
        return store.batch_put_from_multi_buffers(keys, addrs, sizes)

    putter = StoreRowsPutter(slots, store, put, reader, capacity=capacity)
    putter.register()
    return putter


def job_chunks(
    computed_from: int = 0, req_id: str = "req", now: float | None = None
) -> list[ChunkRowsPut]:
    """The three chunks of a store job of TOKENS, as the send thread hands them."""
    job = StoreRowsJob(chains=tuple(CHAINS), computed_from=computed_from)
    now = time.monotonic() if now is None else now
    return chunk_rows_puts(req_id, [0, BS, 2 * BS], BS, HASHES, job, now)


def put_blocks(
    slots: StoreRowsSlots, store: FakeStore, reader: RowsByHash, computed_from: int = 0
) -> list[str]:
    """Store all three chunks' rows objects; the keys put, in order."""
    before = set(store.objects)
    putter = make_putter(slots, store, reader)
    putter.submit(job_chunks(computed_from))
    putter.put_once()
    return [slots.key(h) for h in HASHES if slots.key(h) in set(store.objects) - before]


def load_checks(
    block_ids: list[int], rows_from: int = 0
) -> list[tuple[int, SlotCheck]]:
    """A load of all three blocks into `block_ids`: the checks it needs from
    `rows_from` on."""
    checks = []
    for index, block_id in enumerate(block_ids):
        lo = max(rows_from - index * BS, 0)
        if lo < BS:
            checks.append((index, SlotCheck(block_id, CHAINS[index], lo, BS)))
    return checks


def load_blocks(
    slots: StoreRowsSlots,
    store: FakeStore,
    checks: list[tuple[int, SlotCheck]],
    rejected: list[str] | None = None,
) -> list[int]:
    """The failed block ids of a load; `rejected` gets the keys to remove."""
    get = slots.prepare_get(checks, HASHES)
    codes = store.batch_get_into_multi_buffers(get.keys, get.addrs, get.sizes)
    failed, rejected_keys = slots.check_loaded(checks, get, codes)
    if rejected is not None:
        rejected.extend(rejected_keys)
    return failed


def test_keys_name_the_chunk_hash_rank_zero_and_the_rows_format() -> None:
    prefix = rows_key_prefix(metadata(tp_rank=3, pp_rank=1, store_namespace="/ns"), FMT)
    assert prefix.startswith("tiny-moe/ns/r3rows-v1-")
    assert prefix.endswith("@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0")
    other_format = RowsFormat(num_layers=3, top_k=2, dtype="uint8", block_size=BS)
    assert rows_key_prefix(metadata(), other_format) != rows_key_prefix(metadata(), FMT)
    slots, _, _ = make_slots()
    assert slots.key(HASHES[0]) == slots.key_prefix + "@" + "01" * 32


@pytest.mark.parametrize(
    ("layout", "problem"),
    [
        ((1, True, 16, 16, False), None),
        ((2, True, 16, 16, False), "2 KV cache groups are stored, not one"),
        ((1, False, 16, 16, False), "not full attention"),
        ((1, True, 32, 16, False), "holds several hash blocks of 16"),
        ((1, True, 16, 16, True), "partial-hash hits"),
    ],
)
def test_layouts_that_cannot_carry_rows_are_named(
    layout: tuple[int, bool, int, int, bool], problem: str | None
) -> None:
    found = store_rows_layout_problem(*layout)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_chunks_from_the_one_holding_rows_from_need_rows() -> None:
    assert first_chunk_needing_rows(None, BS) is None
    assert first_chunk_needing_rows(0, BS) == 0
    assert first_chunk_needing_rows(5, BS) == 1  # block 1 holds position 5
    assert first_chunk_needing_rows(8, BS) == 2


def test_rows_round_trip_into_the_mirror_slots_of_the_loaded_blocks() -> None:
    slots, mirror, store = make_slots()
    keys = put_blocks(slots, store, all_rows())
    assert sorted(keys) == sorted(slots.key(h) for h in HASHES)
    assert all(len(store.objects[k]) == FMT.slot_nbytes for k in keys)
    # Loaded into other KV blocks, as a new request would be.
    checks = load_checks([1, 2, 3])
    assert load_blocks(slots, store, checks) == []
    for index, block_id in enumerate([1, 2, 3]):
        rows = mirror.slots[block_id, : FMT.rows_nbytes].reshape(BS, 2, 2)
        np.testing.assert_array_equal(rows, rows_of_block(index))
    assert mirror.slot_problems([check for _, check in checks]) == [None] * 3


def test_only_the_blocks_needing_rows_are_read() -> None:
    slots, _, store = make_slots()
    put_blocks(slots, store, all_rows())
    checks = load_checks([1, 2, 3], rows_from=6)  # blocks 1 and 2 hold rows from 6
    assert [index for index, _ in checks] == [1, 2]
    get = slots.prepare_get(checks, HASHES)
    assert get.keys == [slots.key(HASHES[1]), slots.key(HASHES[2])]
    assert load_blocks(slots, store, checks) == []


def test_chunks_whose_rows_are_missing_get_no_object() -> None:
    slots, _, store = make_slots()
    reader = RowsByHash({HASHES[0]: rows_of_block(0), HASHES[2]: rows_of_block(2)})
    keys = put_blocks(slots, store, reader, computed_from=12)
    assert keys == [slots.key(HASHES[0]), slots.key(HASHES[2])]
    assert reader.reads == 1  # none of them is computed by the job's step: no wait


def test_rows_the_step_still_publishes_are_waited_for() -> None:
    slots, _, store = make_slots()
    reader = RowsByHash({})
    putter = make_putter(slots, store, reader)
    putter.submit(job_chunks(computed_from=4))  # blocks 1 and 2: this step's rows
    putter.put_once()
    assert (reader.reads, putter.waiting, len(store.objects)) == (1, 2, 0)
    # Nothing committed since: a round asks the aux-output store for nothing.
    putter.put_once()
    assert reader.reads == 1
    reader.publish(all_rows().rows_by_hash)  # the step's output is committed
    putter.put_once()
    assert (reader.reads, putter.waiting) == (2, 0)
    assert set(store.objects) == {slots.key(HASHES[1]), slots.key(HASHES[2])}


def test_rows_that_never_come_are_given_up_without_delaying_other_jobs() -> None:
    """An aborted request never publishes its step's rows: its chunks wait until
    their deadline, while another job's chunks are put in the same round."""
    slots, _, store = make_slots()
    reader = RowsByHash({HASHES[0]: rows_of_block(0)})
    putter = make_putter(slots, store, reader)
    putter.submit(
        job_chunks(computed_from=4, req_id="aborted", now=time.monotonic() - 60)
    )
    putter.submit(job_chunks(computed_from=4, req_id="live"))
    putter.put_once()
    assert set(store.objects) == {slots.key(HASHES[0])}
    # The aborted job's two chunks are past their deadline; the live job's wait.
    assert (putter.given_up, putter.waiting) == (2, 2)


def test_chunks_that_have_a_rows_object_are_not_put_again() -> None:
    slots, _, store = make_slots()
    put_blocks(slots, store, all_rows())
    puts = []
    putter = make_putter(slots, store, all_rows())
    putter._put = lambda keys, addrs, sizes: puts.append(keys) or [0] * len(keys)
    putter.submit(job_chunks())
    putter.put_once()
    assert puts == []


def test_more_chunks_than_staging_slots_are_put_in_batches() -> None:
    slots, mirror, store = make_slots()
    putter = make_putter(slots, store, all_rows(), capacity=2)
    putter.submit(job_chunks())
    putter.put_once()
    assert set(store.objects) == {slots.key(h) for h in HASHES}
    # Each object holds its own chunk's rows, though two shared a staging slot.
    assert load_blocks(slots, store, load_checks([1, 2, 3])) == []
    for block_id, index in ((1, 0), (2, 1), (3, 2)):
        rows = mirror.slots[block_id, : FMT.rows_nbytes].reshape(BS, 2, 2)
        np.testing.assert_array_equal(rows, rows_of_block(index))


def test_a_failing_store_costs_the_rows_objects_not_the_putter() -> None:
    slots, _, store = make_slots()
    putter = make_putter(slots, store, all_rows())

    calls: list[int] = []

    def broken(keys: list, *args: object) -> list[int]:
        calls.append(len(keys))
        raise RuntimeError("transfer engine gone")

    putter._put = broken
    putter.submit(job_chunks())
    putter.put_once()  # logged, not raised
    # The planted failure was reached, and cost that round's objects.
    assert (calls, store.objects) == ([3], {})
    putter._put = lambda keys, addrs, sizes: store.batch_put_from_multi_buffers(
        keys, addrs, sizes
    )
    putter.submit(job_chunks())
    putter.put_once()
    assert len(store.objects) == 3


def test_chunks_past_the_job_chains_get_no_rows_put() -> None:
    job = StoreRowsJob(chains=tuple(CHAINS[:2]), computed_from=8)
    puts = chunk_rows_puts("req", [0, BS, 2 * BS], BS, HASHES, job, now=100.0)
    assert [(p.block_hash, p.chain, p.must_wait) for p in puts] == [
        (HASHES[0], CHAINS[0], False),
        (HASHES[1], CHAINS[1], False),
    ]
    assert {p.deadline for p in puts} == {110.0}


@pytest.mark.parametrize(
    "fault",
    ["never-stored", "flipped-byte", "other-tokens", "failed-get", "other-format"],
)
def test_a_bad_rows_object_is_a_load_error_of_its_block(fault: str) -> None:
    slots, mirror, store = make_slots()
    put_blocks(slots, store, all_rows())
    checks = load_checks([1, 2, 3])
    key = slots.key(HASHES[1])
    if fault == "never-stored":
        del store.objects[key]
    elif fault == "flipped-byte":
        value = bytearray(store.objects[key])
        value[3] ^= 1
        store.objects[key] = bytes(value)
    elif fault == "other-tokens":
        index, check = checks[1]
        checks[1] = (index, SlotCheck(check.block_id, CHAINS[2], 0, BS))
    elif fault == "failed-get":
        store.fail_gets.add(key)
    elif fault == "other-format":
        # A reader of another rows format finds none of these objects.
        fmt = RowsFormat(num_layers=2, top_k=2, dtype="uint16", block_size=BS)
        other, _, _ = make_slots(fmt)
        other_store_keys = [other.key(h) for h in HASHES]
        assert not set(other_store_keys) & set(store.objects)
        del store.objects[key]  # what the other format's get of block 1 sees
    rejected: list[str] = []
    assert load_blocks(slots, store, checks, rejected) == [2]
    # An object that was read but failed its check is to be removed; one that could
    # not be read is not there to remove.
    read_but_bad = fault in ("flipped-byte", "other-tokens")
    assert rejected == ([key] if read_but_bad else [])
    # The other blocks passed and hold their rows.
    for block_id, index in ((1, 0), (3, 2)):
        rows = mirror.slots[block_id, : FMT.rows_nbytes].reshape(BS, 2, 2)
        np.testing.assert_array_equal(rows, rows_of_block(index))


def test_a_short_get_never_leaves_an_older_tag_in_the_staging_slot() -> None:
    slots, mirror, store = make_slots()
    put_blocks(slots, store, all_rows())
    checks = load_checks([1, 2, 3])
    assert load_blocks(slots, store, checks) == []
    # The same blocks again, with block 1's object gone: its staging slot must not
    # keep the rows the first load left there.
    del store.objects[slots.key(HASHES[1])]
    mirror.invalidate([1, 2, 3])
    assert load_blocks(slots, store, checks) == [2]
    assert slots.staging.slot_problems([checks[1][1]])[0] is not None


class LeasedStore:
    """`remove` as Mooncake answers it: -706 (OBJECT_HAS_LEASE) while a reader's
    lease holds the object, -704 once it is gone."""

    def __init__(self, keys: set[str]) -> None:
        self.objects = set(keys)
        self.leased = set(keys)

    def remove(self, key: str) -> int:
        if key not in self.objects:
            return -704
        if key in self.leased:
            return -706
        self.objects.discard(key)
        return 0


def test_a_rejected_object_the_store_keeps_stays_rejected_until_removed() -> None:
    rejected = RejectedRowsKeys()
    store = LeasedStore({"a", "b"})
    rejected.add("a")
    rejected.remove_from(store, ["a"])
    # The failed get's lease still holds it: lookups must keep treating it as absent.
    assert rejected.among(["a", "b"]) == ["a"] and "a" in store.objects
    store.leased.clear()
    rejected.remove_from(store, rejected.among(["a", "b"]))
    assert rejected.among(["a", "b"]) == [] and store.objects == {"b"}
    # Already gone (another reader removed it): forgotten too.
    rejected.add("c")
    rejected.remove_from(store, ["c"])
    assert rejected.among(["c"]) == []


def test_rejected_keys_are_bounded_oldest_first() -> None:
    rejected = RejectedRowsKeys(capacity=3)
    for key in "abcd":
        rejected.add(key)
    rejected.add("b")  # seen again: now the newest
    rejected.add("e")
    assert rejected.among(list("abcde")) == ["b", "d", "e"]


def send_thread(
    store: object, putter: StoreRowsPutter | None, put_step: int = 1
) -> object:
    """A real KV send thread (not started) over one KV cache group of BS-token
    blocks, with the rows putter the output rank gives it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        ChunkedTokenDatabase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        KVCacheStoreSendingThread,
        MooncakeStoreCoordinator,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    # vLLM 0.34.0 names the chunk `chunk_size`; earlier bases `block_size`.
    size = (
        "chunk_size"
        if "chunk_size" in inspect.signature(ChunkedTokenDatabase).parameters
        else "block_size"
    )
    db = ChunkedTokenDatabase(metadata(), **{size: BS})
    db.set_kv_caches_base_addr([0x1000])
    db.set_block_len([256])
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=None)
    coord = MooncakeStoreCoordinator(
        [KVCacheGroupSpec(["layer0"], spec)],
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    thread = KVCacheStoreSendingThread(
        store=store,
        coord=coord,
        token_databases=[db],
        block_size=BS,
        tp_rank=0,
        group_put_steps=[put_step],
        kv_role="kv_producer",
        ready_event=threading.Event(),
        replicate_config=object(),
        rows_putter=putter,
    )
    thread.request_queue.task_done = lambda: None
    return thread


def kv_store() -> MagicMock:
    """Mooncake's client as the KV put sees it: nothing stored yet, puts succeed."""
    store = MagicMock()
    store.batch_is_exist.side_effect = lambda keys: [0] * len(keys)
    store.batch_put_from_multi_buffers.side_effect = lambda keys, *a: [0] * len(keys)
    return store


def run_store_job(thread: object, job_id: int) -> None:
    req = ReqMeta(
        req_id="req",
        token_len_chunk=3 * BS,
        block_ids=([1, 2, 3],),
        block_hashes=list(HASHES),
        can_save=True,
        store_job_id=job_id,
        # Every block is computed by the job's step: its rows come after it.
        rows=StoreRowsJob(chains=tuple(CHAINS), computed_from=0),
    )
    thread.add_request(req)
    thread._handle_request(thread.request_queue.get())


def test_the_send_thread_never_waits_for_rows_nor_holds_the_job_for_them() -> None:
    """The step's rows are not published (a planted delay: they never come).
    The send thread still finishes the job, releasing its KV blocks, without
    reading a row; the putter has its chunks."""
    slots, _, store = make_slots()
    reader = RowsByHash({})
    putter = make_putter(slots, store, reader)
    thread = send_thread(kv_store(), putter)
    run_store_job(thread, job_id=7)
    assert thread.take_completed_saves() == {7: 1}
    assert reader.reads == 0
    putter.put_once()
    assert (reader.reads, putter.waiting) == (1, 3)
    reader.publish(all_rows().rows_by_hash)
    putter.put_once()
    assert set(store.objects) == {slots.key(h) for h in HASHES}


def test_a_rows_hand_over_that_raises_never_keeps_the_job_blocks() -> None:
    slots, _, store = make_slots()
    putter = make_putter(slots, store, RowsByHash({}))

    calls: list[int] = []

    def broken(chunks: list) -> None:
        calls.append(len(chunks))
        raise RuntimeError("planted")

    putter.submit = broken
    thread = send_thread(kv_store(), putter)
    run_store_job(thread, job_id=8)  # logged, not raised
    # The hand-over was reached with the job's 3 chunks, and the job completed.
    assert calls == [3]
    assert thread.take_completed_saves() == {8: 1}


@pytest.mark.parametrize("put_step", [1, 2, 3])
def test_the_output_rank_puts_every_chunks_rows_whatever_the_put_stride(
    put_step: int,
) -> None:
    """With Mooncake's put stride (TP > 1 and fewer KV heads than ranks) each rank
    puts only its share of the chunks' KV; rank 0 here puts chunks 0 and 2 with a
    stride of 2, chunk 0 with 3. Only the output rank puts rows, so it puts the
    rows object of every chunk of the job: a chunk another rank stored is a hit
    with its rows. Before, it put rows only for its own share (lost hits)."""
    slots, _, store = make_slots()
    reader = RowsByHash(all_rows().rows_by_hash)
    putter = make_putter(slots, store, reader)
    kv = kv_store()
    thread = send_thread(kv, putter, put_step=put_step)
    run_store_job(thread, job_id=9)
    kv_keys = [
        k
        for call in kv.batch_put_from_multi_buffers.call_args_list
        for k in call.args[0]
    ]
    assert len(kv_keys) == len(range(0, 3, put_step))  # this rank's KV share
    putter.put_once()
    assert set(store.objects) == {slots.key(h) for h in HASHES}
