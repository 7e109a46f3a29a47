"""BlockManager: KV blocks, reference counts, block tables and the prefix cache.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. A sequence's
block table lists its blocks in order; token ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching: a full block's hash chains over all token ids up to its end,
``hash_i = H(hash_{i-1}, tokens of block i)``, and is registered only once the
block's KV is computed. Every hit is verified against the stored token ids. A
freed block keeps its hash and content until the free list reuses it (LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()


def chain_hash(prefix_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(prefix_hash or b"")
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than needed."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block_id: dict[bytes, int] = {}
        self.num_prefix_hits = 0  # blocks reused from the prefix cache

    # -- counters ---------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> dict[str, int]:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_blocks - self.num_free_blocks,
            "num_cached_blocks": len(self.hash_to_block_id),
            "num_prefix_hit_blocks": self.num_prefix_hits,
        }

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- raw blocks ---------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks (ref count 1). Raises NoFreeBlocksError."""
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {self.num_free_blocks} free")
        return [self._take(next(iter(self.free_block_ids)), keep_content=False) for _ in range(num_blocks)]

    def _take(self, block_id: int, keep_content: bool) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
            if not keep_content and block.hash is not None:  # evict its cached content
                if self.hash_to_block_id.get(block.hash) == block_id:
                    del self.hash_to_block_id[block.hash]
                block.hash, block.token_ids = None, ()
        block.ref_count += 1
        return block_id

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks at zero go to the free list (tail last = evicted first)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None

    # -- sequences ----------------------------------------------------------------

    def allocate_prefix(self, seq: Sequence) -> None:
        """Give a new sequence the cached blocks of its longest verified prefix.

        At least one token is always left to compute (its logits are needed), and a
        cached block is never written again, so hits stop before the last token's block.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return
        prefix_hash = seq.kv_salt
        max_hits = (seq.num_tokens - 1) // self.block_size
        for i in range(max_hits):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prefix_hash = chain_hash(prefix_hash, tokens)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            seq.block_table.append(self._take(block_id, keep_content=True))
            self.num_prefix_hits += 1
        seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold ``num_tokens`` tokens; False (nothing taken) if the pool is short."""
        needed = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if not self.can_allocate(needed):
            return False
        seq.block_table.extend(self.allocate_blocks(needed))
        return True

    def mark_computed(self, seq: Sequence, num_computed_before: int) -> None:
        """Register the hashes of blocks that became full in the last step."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = num_computed_before // bs, seq.num_computed_tokens // bs
        prefix_hash = self.blocks[seq.block_table[first - 1]].hash if first > 0 else seq.kv_salt
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if block.hash is None:
                block.hash = chain_hash(prefix_hash, tokens)
                block.token_ids = tokens
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
            prefix_hash = block.hash

    def fork(self, block_table: list[int], num_tokens: int, num_forks: int) -> tuple[list[list[int]], list[tuple[int, int]]] | None:
        """``num_forks`` block tables for copies of a sequence whose first ``num_tokens`` tokens'
        KV is in ``block_table``: the first is ``block_table`` itself; the others share its full
        blocks (one more reference each) and get a fresh block for a partly filled last one,
        which the next token of each fork writes into (copy-on-write, done at fork time as every
        fork writes next). Returns (tables, [(source block, new block)] whose KV the caller
        copies), or None with nothing taken if the pool is short."""
        num_full, partial = divmod(num_tokens, self.block_size)
        assert len(block_table) == num_full + (partial > 0), "the table must hold exactly num_tokens tokens"
        num_copies = (num_forks - 1) * (partial > 0)
        if not self.can_allocate(num_copies):
            return None
        tables, copies = [block_table], []
        for _ in range(num_forks - 1):
            table = [self._take(b, keep_content=True) for b in block_table[:num_full]]
            if partial:
                (new,) = self.allocate_blocks(1)
                copies.append((block_table[num_full], new))
                table.append(new)
            tables.append(table)
        return tables, copies

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table[seq.num_dead_blocks :])
        seq.block_table = []
        seq.num_computed_tokens = seq.num_dead_blocks = 0

    def free_leading(self, seq: Sequence, num_blocks: int) -> None:
        """Give back ``seq``'s first ``num_blocks`` blocks (those not given back yet), keeping
        their ids in its table (a sliding window no longer reaches them)."""
        if num_blocks > seq.num_dead_blocks:
            self.free_blocks(seq.block_table[seq.num_dead_blocks : num_blocks])
            seq.num_dead_blocks = num_blocks
