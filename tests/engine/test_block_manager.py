"""Block manager: on-demand allocation, ref counts, LRU free queue and prefix-cache invariants."""

from __future__ import annotations

import random

import pytest

from batchinfer.engine.core.block_manager import BlockManager, FreeBlockQueue, KVCacheBlock, hash_block
from batchinfer.engine.core.sequence import Sequence
from batchinfer.engine.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], *, salt: str | None = None) -> Sequence:
    return Sequence("r", tokens, SamplingParams(), max_tokens=16, cache_salt=salt)


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> bool:
    """What the scheduler does for a queued sequence: look up the cache, then allocate the rest."""
    hits = bm.get_computed_blocks(seq)
    cached = len(hits) * bm.block_size
    ok = bm.allocate_slots(seq, (seq.num_tokens - cached) if num_new is None else num_new, hits)
    if ok:
        seq.num_computed_tokens = cached
    return ok


def compute(seq: Sequence, num_new: int) -> None:
    seq.num_computed_tokens += num_new


def test_blocks_are_allocated_on_demand_and_freed() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(6)))
    assert admit(bm, seq)
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2
    compute(seq, 6)
    for token in (6, 7):  # decode into the second block: no new block until position 8
        seq.token_ids.append(token)
        assert bm.allocate_slots(seq, 1)
        compute(seq, 1)
        assert len(seq.block_table) == 2
    seq.token_ids.append(8)
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 3
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(3, BS)
    first, second = make_seq(list(range(8))), make_seq(list(range(100, 108)))
    assert admit(bm, first)
    assert not admit(bm, second)  # needs 2, only 1 free
    assert second.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([first, second])


def test_double_free_is_refused_rather_than_going_negative() -> None:
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(5)))
    assert admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table  # a buggy caller freeing twice
    with pytest.raises(RuntimeError, match="negative ref_cnt"):
        bm.free(seq)


def test_shared_full_blocks_are_hit_and_counted() -> None:
    """Two prompts sharing 3 full blocks: the second gets exactly 3 block hits (12 tokens)."""
    bm = BlockManager(16, BS)
    shared = list(range(12))
    a, b = make_seq(shared + [50, 51]), make_seq(shared + [60, 61, 62])
    assert admit(bm, a)
    compute(a, a.num_tokens)
    assert bm.stats.block_hits == 0 and bm.stats.queries == 14
    assert admit(bm, b)
    assert b.num_computed_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert [bm.blocks[i].ref_cnt for i in b.block_table[:3]] == [2, 2, 2]
    assert bm.stats.block_hits == 3 and bm.stats.hits == 12
    assert bm.stats.queries == 14 + 15 and bm.stats.block_queries == 3 + 3
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])


def test_last_token_is_always_recomputed() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(12))  # exactly 3 full blocks
    a, b = make_seq(prompt), make_seq(prompt)
    assert admit(bm, a)
    compute(a, 12)
    assert admit(bm, b)
    assert b.num_computed_tokens == 8  # capped at 11 tokens, rounded down to 2 blocks
    assert b.block_table[2] != a.block_table[2]
    # b's third block fills with content already cached by a: it stays unhashed (one block per hash).
    assert bm.blocks[b.block_table[2]].block_hash is None
    bm.check_invariants([a, b])


def test_salted_requests_never_share_blocks_across_salts() -> None:
    bm = BlockManager(32, BS)
    prompt = list(range(13))
    owner = make_seq(prompt, salt="alice")
    assert admit(bm, owner)
    compute(owner, 13)
    for salt, expected in ((None, 0), ("bob", 0), ("alice", 12)):
        seq = make_seq(prompt, salt=salt)
        assert admit(bm, seq)
        assert seq.num_computed_tokens == expected, salt
        shared = set(seq.block_table) & set(owner.block_table)
        assert len(shared) == expected // BS, salt


def test_namespace_separates_models() -> None:
    one, two = BlockManager(8, BS, namespace="model-a"), BlockManager(8, BS, namespace="model-b")
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    one.get_computed_blocks(a)
    two.get_computed_blocks(b)
    assert a.block_hashes and a.block_hashes[0] != b.block_hashes[0]


def test_block_hash_is_chained_over_parent_tokens_and_extra_keys() -> None:
    h1 = hash_block(bytes(32), [1, 2, 3, 4], b"x")
    assert h1 == hash_block(bytes(32), [1, 2, 3, 4], b"x")
    assert h1 != hash_block(bytes(32), [1, 2, 3, 5], b"x")
    assert h1 != hash_block(bytes(32), [1, 2, 3, 4], b"y")
    assert hash_block(h1, [5, 6, 7, 8], b"x") != hash_block(bytes(32), [5, 6, 7, 8], b"x")
    # A large id does not alias small ones (fixed-width little-endian encoding).
    assert hash_block(bytes(32), [256, 0, 0, 0], b"") != hash_block(bytes(32), [0, 1, 0, 0], b"")


def test_freed_cached_blocks_stay_hittable_until_evicted_lru() -> None:
    bm = BlockManager(6, BS)
    a = make_seq(list(range(8)) + [99])  # 2 full blocks + 1 token
    assert admit(bm, a)
    compute(a, 9)
    table = list(a.block_table)
    prefix_blocks = table[:2]
    bm.free(a)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
    # Tail first: a's partial last block, then block 1, then block 0 joined the free queue's tail.
    assert [block.block_id for block in bm.free_queue][-3:] == [table[2], table[1], table[0]]

    again = make_seq(list(range(8)) + [77])
    assert admit(bm, again)
    assert again.block_table[:2] == prefix_blocks and again.num_computed_tokens == 8
    bm.free(again)

    # A stranger needing all 6 blocks evicts the cached ones (least recently freed first).
    stranger = make_seq(list(range(200, 224)))
    assert admit(bm, stranger)
    assert bm.num_free_blocks == 0
    assert bm.num_cached_blocks == 6  # its own 6 full blocks; the old prefix was evicted
    assert bm.stats.evictions == 2
    bm.free(stranger)
    late = make_seq(list(range(8)) + [77])
    assert bm.get_computed_blocks(late) == []
    bm.check_invariants([])


def test_eviction_prefers_least_recently_freed() -> None:
    bm = BlockManager(4, BS)
    old, new = make_seq(list(range(4)) + [1]), make_seq(list(range(10, 14)) + [1])
    for seq in (old, new):
        assert admit(bm, seq)
        compute(seq, 5)
    bm.free(old)  # freed first -> evicted first
    bm.free(new)
    filler = make_seq([500, 501, 502])  # takes exactly one free block
    assert admit(bm, filler)
    hits_old = bm.get_computed_blocks(make_seq(list(range(4)) + [2]))
    hits_new = bm.get_computed_blocks(make_seq(list(range(10, 14)) + [2]))
    # 4 free blocks after both frees: [old tail, old block0, new tail, new block0]; the filler took old tail.
    assert len(hits_old) == 1 and len(hits_new) == 1
    filler2 = make_seq([600, 601, 602])
    assert admit(bm, filler2)  # takes old block 0
    assert bm.get_computed_blocks(make_seq(list(range(4)) + [2])) == []
    assert len(bm.get_computed_blocks(make_seq(list(range(10, 14)) + [2]))) == 1


def test_block_filled_during_decode_is_registered() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq([1, 2, 3])
    assert admit(bm, seq)
    compute(seq, 3)
    assert bm.num_cached_blocks == 0
    seq.token_ids.append(4)  # decode the 4th token: the first block becomes full
    assert bm.allocate_slots(seq, 1)
    compute(seq, 1)
    assert bm.num_cached_blocks == 1
    seq.token_ids.append(5)
    other = make_seq([1, 2, 3, 4, 9])
    assert admit(bm, other)
    assert other.num_computed_tokens == 4 and other.block_table[0] == seq.block_table[0]


def test_hit_on_a_free_cached_block_costs_a_free_slot() -> None:
    bm = BlockManager(3, BS)
    a = make_seq(list(range(8)) + [1])
    assert admit(bm, a)
    compute(a, 9)
    bm.free(a)
    busy = make_seq([900])
    assert admit(bm, busy)  # evicts a's partial tail block (freed first)
    b = make_seq(list(range(8)) + [2, 3, 4, 5, 6])  # 2 hits (both free) + 2 new blocks = 4 > 2 free
    assert not admit(bm, b)
    assert b.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([busy])


def test_disabled_prefix_caching_never_hits_or_hashes() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    assert admit(bm, a)
    compute(a, 9)
    assert admit(bm, b)
    assert b.num_computed_tokens == 0 and bm.num_cached_blocks == 0 and bm.stats.queries == 0


def test_reset_prefix_cache_only_when_idle() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    assert admit(bm, a)
    compute(a, 9)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.num_cached_blocks == 2
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.get_computed_blocks(make_seq(list(range(9)))) == []
    bm.check_invariants([])


def test_free_queue_operations_are_linked_list_constant_time() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2] and queue.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])  # not in the queue


def test_random_workload_keeps_every_invariant() -> None:
    rng = random.Random(7)
    bm = BlockManager(24, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 13))] for _ in range(4)]
    live: list[Sequence] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.35 or not live:
            seq = make_seq(
                rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))],
                salt=rng.choice([None, "s"]),
            )
            if admit(bm, seq, num_new=None):
                compute(seq, seq.num_tokens - seq.num_computed_tokens)
                live.append(seq)
        elif action < 0.75:
            seq = rng.choice(live)
            seq.token_ids.append(rng.randrange(50))
            if bm.allocate_slots(seq, 1):
                compute(seq, 1)
            else:
                seq.token_ids.pop()
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0 and bm.stats.block_hits > 0
