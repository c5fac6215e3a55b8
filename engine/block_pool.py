"""Fixed-size KV blocks: free blocks placed in consecutive runs, reference counts, an optional prefix cache.

Placement: a request's blocks are taken as one run of consecutive ids where the pool has one, at the
lowest such ids, and a growing request continues its own run (the block after its last one) while that
is free. A fresh run leaves room for the request's expected growth after it, and as much behind it for
the request whose run it follows. Why: on CPU the attention gathers every sequence's context from the
cache slot by slot; with the blocks scattered over the pool, the same plain 8-sequence SmolLM2 decode
forwards took 1.05-1.07x as long as with each request's blocks consecutive (docs/bench/issue20-kv-
layout-s30), and a server's free queue, reused last-freed-first, ended up fully scattered within a few
hundred requests (docs/bench/issue20-serve-smollm2-epyc512-c8-pooled-s31/probe8/layout.txt; the old
queue against this placement in-process: docs/bench/issue20-kv-placement-s31). Lowest ids first also
keeps the pool's working set small: on CPU its pages are only committed once written.

A freed block keeps its hash and waits, least recently freed first, for a later request whose prefix
hashes to it (a prefix-cache hit takes it back instead of recomputing it); cached blocks are evicted in
that order only when no block without cached content is free. Blocks are keyed by a SHA-256 chain
(`BlockHash`, computed by the KV cache manager), so two different prefixes never share a key: a
collision would hand one request another request's KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockHash = bytes  # 32-byte SHA-256 digest of (parent block's hash, this block's token ids)

# The most blocks a fresh run keeps free after itself for its request's growth (and before itself for
# its neighbour's): 16 blocks of 16 tokens. More would rarely find a free run in a busy pool.
MAX_GROWTH_ROOM = 16
_FREE, _TAKEN = 1, 0


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
        # One byte per block, _FREE where the block is free and holds no cached content: runs of free
        # blocks are found by bytearray.find, a C-speed scan (~1.5 us to miss a run of 34 over 8k).
        self._open = bytearray([_FREE]) * num_blocks
        self._num_open = num_blocks
        # Free blocks holding cached content, least recently freed first (eviction order).
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self._num_open + len(self._cached_free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int, after: int | None = None, growth: int = 0) -> list[int]:
        """`n` blocks for one request, in the order it uses them. `after`: the request's last block,
        whose run it continues where the next blocks are free; `growth`: how many more blocks the
        request expects to need later (room left free after a fresh run)."""
        if n > self.num_free_blocks:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        ids: list[int] = []
        if after is not None:
            end = after + 1
            while len(ids) < n and end < len(self._open) and self._open[end] == _FREE:
                ids.append(end)
                end += 1
            self._take_open(ids)
        if len(ids) < n:
            ids += self._fresh_run(n - len(ids), min(growth, MAX_GROWTH_ROOM))
        for block_id in ids:
            self.blocks[block_id].ref_count = 1
        return ids

    def _fresh_run(self, n: int, room: int) -> list[int]:
        """`n` blocks at the lowest free run that fits them with room around, else without, else the
        lowest open blocks wherever they are, then cached ones (least recently freed first)."""
        for width, lead in ((room + n + room, room), (n + room, 0), (n, 0)):
            start = self._open.find(bytes([_FREE]) * width)
            if start >= 0:
                # The leftmost run starts after a taken block (or at 0): `lead` leaves that block's
                # request room to continue its own run.
                first = start + (lead if start > 0 else 0)
                ids = list(range(first, first + n))
                self._take_open(ids)
                return ids
        ids = []
        at = self._open.find(_FREE)
        while at >= 0 and len(ids) < n:
            ids.append(at)
            at = self._open.find(_FREE, at + 1)
        self._take_open(ids)
        evicted = [self._cached_free.popitem(last=False)[0] for _ in range(n - len(ids))]
        for block_id in evicted:
            block = self.blocks[block_id]
            self._cached.pop(block.block_hash, None)  # type: ignore[arg-type]  # cached => hashed
            block.block_hash = None
        # A request freed tail first comes back out in descending ids; ascending reads consecutively.
        return ids + sorted(evicted)

    def _take_open(self, ids: list[int]) -> None:
        for block_id in ids:
            self._open[block_id] = _TAKEN
        self._num_open -= len(ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; pass the tail first so it is evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._open[block_id] = _FREE
                    self._num_open += 1
                else:
                    self._cached_free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        self.num_queries += 1
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            self.num_hits += 1
        return block_id

    def take_cached(self, block_id: int) -> None:
        """Add a reference to a cached block found by `lookup` (reviving it from the free ones)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._cached_free[block_id]
        block.ref_count += 1

    def mark_cached(self, block_id: int, block_hash: BlockHash) -> None:
        """Publish a held block's content under `block_hash`."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"KV block {block_id} is free: only held blocks are published")
        if block.block_hash is not None or block_hash in self._cached:
            return  # already cached, or identical content cached in another block
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
