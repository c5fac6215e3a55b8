"""Fixed-size KV blocks: a free queue with reference counts and an optional prefix-hash cache.

A freed block keeps its hash and sits in the free queue in LRU order; if a later request's prefix
hashes to it before it is reused, it is taken back out (a prefix-cache hit) instead of recomputed.
A freed block with no cached content goes to the front instead and is reused first: the pool's
working set stays small (on CPU the pool's pages are only committed once written) and cache-warm.
Blocks are keyed by a SHA-256 chain (`BlockHash`, computed by the KV cache manager), so two different
prefixes never share a key: a collision would hand one request another request's KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockHash = bytes  # 32-byte SHA-256 digest of (parent block's hash, this block's token ids)


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Insertion order = eviction order (least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached content
                self._cached.pop(block.block_hash, None)
                block.block_hash = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; pass the tail first so it is evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:  # nothing worth keeping: reuse this one first
                    self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: BlockHash) -> int | None:
        self.num_queries += 1
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            self.num_hits += 1
        return block_id

    def take_cached(self, block_id: int) -> None:
        """Add a reference to a cached block found by `lookup` (reviving it from the free queue)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def mark_cached(self, block_id: int, block_hash: BlockHash) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return  # already cached, or identical content cached in another block
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
