"""Per-request block tables on top of the BlockPool (no torch; the tensors live in the model runner)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from .block_pool import BlockHash, BlockPool
from .request import Request

_HASH_DOMAIN = b"specserve prefix cache v1\0"

# Cost, measured on a shared 2-core CPU (timeit, CPython 3.11): ~3-5 us per 16-token block (hash()
# was ~0.9 us). Keys are computed incrementally: a decode step hashes only the blocks that filled in
# it, e.g. 32 requests x ~5 tokens/step / 16 x 5 us = ~50 us, 0.25% of a 20 ms SmolLM2 step.
# Publishing a 2k-token prompt (~1.2 ms) happens once, after a prefill that takes seconds; an
# admission hashes only while it hits (a miss costs one block, a full 2k hit ~0.9 ms saves the prefill).


def root_block_hash(cache_salt: str) -> BlockHash:
    """Start of every hash chain: whatever besides the token ids changes the KV (model identity)."""
    return hashlib.sha256(_HASH_DOMAIN + cache_salt.encode()).digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256 of the parent block's 32-byte digest followed by the token ids as native int64s.

    Chained through the parent, a key names the whole prefix up to and including this block; the
    parent has a fixed length, so the encoding is unambiguous.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, cache_salt: str = ""):
        """`cache_salt` names what the KV depends on besides the tokens (target and draft model)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._root_hash = root_block_hash(cache_salt)
        self._hashes: dict[str, list[BlockHash]] = {}  # request id -> hashes of its full computed blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def _block_hash(self, tokens: list[int], block: int, parent: BlockHash | None) -> BlockHash:
        """Key of block number `block` of `tokens`; `parent` is the previous block's (None for the first)."""
        chunk = tokens[block * self.block_size : (block + 1) * self.block_size]
        return hash_block_tokens(self._root_hash if parent is None else parent, chunk)

    def reuse_cached_prefix(self, request: Request) -> int:
        """On admission: attach cached blocks of the longest known prefix; returns tokens reused.

        At least one token is always left to compute so the step produces logits to sample from.
        Blocks are hashed one at a time and only until the first miss.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return 0
        tokens = request.all_token_ids
        hashes: list[BlockHash] = []
        for b in range((len(tokens) - 1) // self.block_size):
            h = self._block_hash(tokens, b, hashes[-1] if hashes else None)
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            self.pool.take_cached(block_id)
            request.block_ids.append(block_id)
            hashes.append(h)
        self._hashes[request.request_id] = hashes
        return len(request.block_ids) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_speculative_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` (+ draft lookahead) beyond the computed tokens; False if full."""
        total = request.num_computed_tokens + num_new_tokens + num_speculative_tokens
        need = self.blocks_needed(total) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        last = request.block_ids[-1] if request.block_ids else None
        growth = self._expected_blocks(request) - len(request.block_ids) - need
        request.block_ids.extend(self.pool.allocate(need, after=last, growth=max(0, growth)))
        return True

    def _expected_blocks(self, request: Request) -> int:
        """Blocks the request will hold at its end if it runs to max_tokens (room to grow in place)."""
        if request.params.max_tokens is None:  # unbounded: as much room as the pool gives a run
            return 1 << 30
        return self.blocks_needed(len(request.prompt_token_ids) + request.params.max_tokens)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full, computed blocks for reuse by later requests with the same prefix."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        known = self._hashes.setdefault(request.request_id, [])
        if num_full <= len(known):
            return
        tokens = request.all_token_ids
        for b in range(len(known), num_full):  # only the blocks that filled since the last call
            known.append(self._block_hash(tokens, b, known[-1] if known else None))
            self.pool.mark_cached(request.block_ids[b], known[b])

    def free(self, request: Request) -> None:
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        self._hashes.pop(request.request_id, None)
