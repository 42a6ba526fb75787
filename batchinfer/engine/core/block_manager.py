"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, and the prefix cache.

The block manager owns no tensors; it decides which physical block holds which positions. The model
runner writes K/V for position p of a sequence into slot block_table[p // block_size] * block_size +
p % block_size.

Invariants (checked by `check_invariants`):

1. ref_cnt of a block == the number of live sequences whose block_table contains it; never negative.
2. A block is in the free queue  <=>  its ref_cnt == 0. Free blocks may still hold a cached prefix.
3. block.block_hash is not None  <=>  cached_blocks[block.block_hash] is that block. One block per hash:
   when a second block fills with content already cached, it stays unhashed and is simply freed later.
4. A hashed block is FULL and its content is final: its K/V holds exactly the block_size tokens whose
   chained hash it carries. Sequences only write positions >= their num_computed_tokens, and a prefix
   hit ends on a block boundary, so nobody ever writes into a hashed block.
5. Blocks are hashed when they are allocated for the step that fills them (like vLLM), i.e. possibly
   before that step's forward pass has run, and only as far as seq.token_ids reaches (the slots a
   speculative step allocates for its draft tokens hold tokens that are not accepted yet). Another
   sequence admitted in the same step may then share
   them: this is safe because within each layer the model runner stores the whole step's K/V
   (store_kvcache) before any attention reads the cache.
6. Eviction order: the free queue is least-recently-freed first. A sequence frees its blocks tail
   first, so its prefix blocks (the ones most worth keeping) are evicted last. Allocation pops the head;
   popping a hashed block evicts it from the cache (O(1): doubly linked list + dict).
7. Block hash of block i of a sequence: sha256(hash of block i-1 (32 zero bytes for i == 0)
   || token ids of block i as little-endian int64 || extra keys), extra keys = (model namespace,
   cache_salt, LoRA adapter key or None). Equal hashes therefore mean equal model, salt, adapter and whole
   token prefix (sha256 is collision-safe), so a salted request never hits another salt's blocks, and a
   block computed under one adapter is never reused for another adapter or the base model.
8. The last token of a sequence is never served from the cache (its logits are needed): the cached
   length is capped at num_tokens - 1, rounded down to a whole block.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence as SeqOf
from dataclasses import dataclass

from batchinfer.engine.core.sequence import Sequence

NONE_HASH = bytes(32)  # parent hash of the first block


class KVCacheBlock:
    """One physical KV block: id, reference count, prefix-cache hash and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head; every operation is O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (most recently freed)."""
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a cache hit on a free block)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since start: queries/hits in tokens (as vLLM exports them) and in blocks."""

    queries: int = 0  # tokens of admitted sequences that asked the cache
    hits: int = 0  # of those, tokens served from the cache
    block_queries: int = 0  # full blocks that could have been served (num_tokens - 1 rounded down)
    block_hits: int = 0
    evictions: int = 0  # cached blocks reused for new content


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to sequences on demand and shares full blocks through the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        namespace: str = "",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.stats = PrefixCacheStats()
        self._num_hashed: dict[int, int] = {}  # seq_id -> leading blocks of its table already hashed
        # (cache_salt, adapter key) -> encoded extra keys
        self._extra_keys: dict[tuple[str | None, str | None], bytes] = {}

    # --- figures -------------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (including cached ones that can still be hit or evicted)."""
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return len(self.blocks) - self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (vLLM's kv_cache_usage_perc, as 0..1)."""
        return self.num_used_blocks / len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or free)."""
        return len(self.cached_blocks)

    # --- prefix cache lookup -------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[KVCacheBlock]:
        """The longest cached prefix of `seq` as blocks (no side effects; commit with allocate_slots)."""
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size  # invariant 8
        hits: list[KVCacheBlock] = []
        for block_hash in self._block_hashes(seq, num_full):
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- allocation ----------------------------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Give `seq` blocks for its next `num_new_tokens` tokens; False (and no change) if short of blocks.

        `new_computed_blocks` (from get_computed_blocks) marks an admission: those blocks head the new
        block table, and the lookup is counted in the prefix-cache stats. The caller then sets
        seq.num_computed_tokens = len(new_computed_blocks) * block_size.
        """
        bs = self.block_size
        if new_computed_blocks is None:  # a running sequence's next chunk (every decode step): fast path
            num_total_tokens = seq.num_computed_tokens + num_new_tokens
            if num_total_tokens <= len(seq.block_table) * bs:  # fits the blocks it already holds
                if self.enable_prefix_caching:
                    self._hash_full_blocks(seq, num_total_tokens)
                return True
        hits = new_computed_blocks or []
        if hits and (seq.block_table or seq.num_computed_tokens):
            raise RuntimeError(f"{seq} already holds blocks; cached blocks only head a fresh table")
        num_total_tokens = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(num_total_tokens, self.block_size) - len(seq.block_table) - len(hits)
        # Hitting a free cached block takes it out of the free queue, so it costs a free block too.
        num_revived = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.free_queue.num_free_blocks:
            return False

        for block in hits:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            seq.block_table.append(block.block_id)
        for _ in range(max(num_new_blocks, 0)):
            block = self._pop_free_block()
            block.ref_cnt = 1
            seq.block_table.append(block.block_id)

        if self.enable_prefix_caching:
            if new_computed_blocks is not None:
                self._record_lookup(seq, len(hits))
            self._hash_full_blocks(seq, num_total_tokens)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (finish, abort or preemption); cached ones stay hittable."""
        for block_id in reversed(seq.block_table):  # tail first: prefix blocks are evicted last
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"negative ref_cnt on block {block_id} freeing {seq}")
            if block.ref_cnt == 0:
                self.free_queue.append(block)
        seq.block_table = []
        self._num_hashed.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no sequence holds blocks (returns False then)."""
        if self.num_used_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    # --- internals -----------------------------------------------------------------------------------

    def _pop_free_block(self) -> KVCacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            del self.cached_blocks[block.block_hash]
            block.block_hash = None
            self.stats.evictions += 1
        return block

    def _record_lookup(self, seq: Sequence, num_hit_blocks: int) -> None:
        self.stats.queries += seq.num_tokens
        self.stats.hits += num_hit_blocks * self.block_size
        self.stats.block_queries += (seq.num_tokens - 1) // self.block_size
        self.stats.block_hits += num_hit_blocks

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once `num_tokens` tokens of `seq` are computed.

        Capped at seq.token_ids: a speculative step's lookahead slots hold draft tokens that are not in
        token_ids yet (and may be rejected), so only blocks of accepted tokens are ever hashed.
        """
        num_full = min(num_tokens, len(seq.token_ids)) // self.block_size
        start = self._num_hashed.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and hashes[i] not in self.cached_blocks:
                block.block_hash = hashes[i]
                self.cached_blocks[hashes[i]] = block
        self._num_hashed[seq.seq_id] = num_full

    def _block_hashes(self, seq: Sequence, num_full: int) -> list[bytes]:
        """seq.block_hashes extended to at least `num_full` blocks (hashed once per sequence)."""
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_full:
            lora = seq.lora_request
            keys = (seq.cache_salt, None if lora is None else lora.cache_key)
            extra = self._extra_keys.get(keys)
            if extra is None:
                # The base model's keys stay [namespace, salt]: its hashes are the ones before LoRA existed.
                fields = [self.namespace, *keys] if lora else [self.namespace, seq.cache_salt]
                extra = json.dumps(fields).encode()
                self._extra_keys[keys] = extra
            for i in range(len(hashes), num_full):
                parent = hashes[i - 1] if i else NONE_HASH
                hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def check_invariants(self, live_seqs: SeqOf[Sequence] | None = None) -> None:
        """Assert invariants 1-3; with `live_seqs`, ref counts must match their block tables exactly."""
        free_ids = {block.block_id for block in self.free_queue}
        assert len(free_ids) == self.free_queue.num_free_blocks, "free queue count drifted"
        expected_refs = [0] * len(self.blocks)
        for seq in live_seqs or ():
            for block_id in seq.block_table:
                expected_refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref_cnt: {block}"
            if live_seqs is not None:
                assert block.ref_cnt == expected_refs[block.block_id], f"ref_cnt mismatch: {block}"
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), f"free queue mismatch: {block}"
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, f"hash map mismatch: {block}"
        assert all(b.block_hash == h for h, b in self.cached_blocks.items()), "stale hash map entry"


def hash_block(parent_hash: bytes, token_ids: SeqOf[int], extra_keys: bytes) -> bytes:
    """Chained hash of one full block: sha256(parent || tokens as little-endian int64 || extra keys)."""
    digest = hashlib.sha256(parent_hash)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(extra_keys)
    return digest.digest()
