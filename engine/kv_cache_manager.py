"""Per-request block tables on top of the BlockPool (no torch; the tensors live in the model runner)."""

from __future__ import annotations

from .block_pool import BlockPool
from .request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._hashes: dict[str, list[int]] = {}  # request id -> hashes of its full computed blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def _block_hashes(self, tokens: list[int], num_full_blocks: int) -> list[int]:
        hashes, parent = [], 0
        for b in range(num_full_blocks):
            parent = hash((parent, tuple(tokens[b * self.block_size : (b + 1) * self.block_size])))
            hashes.append(parent)
        return hashes

    def reuse_cached_prefix(self, request: Request) -> int:
        """On admission: attach cached blocks of the longest known prefix; returns tokens reused.

        At least one token is always left to compute so the step produces logits to sample from.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return 0
        tokens = request.all_token_ids
        hashes = self._block_hashes(tokens, (len(tokens) - 1) // self.block_size)
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            self.pool.take_cached(block_id)
            request.block_ids.append(block_id)
        num = len(request.block_ids) * self.block_size
        self._hashes[request.request_id] = hashes[: len(request.block_ids)]
        return num

    def allocate_slots(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` (+ draft lookahead) beyond the computed tokens; False if full."""
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full, computed blocks for reuse by later requests with the same prefix."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        known = self._hashes.setdefault(request.request_id, [])
        if num_full <= len(known):
            return
        hashes = self._block_hashes(request.all_token_ids, num_full)
        for b in range(len(known), num_full):
            self.pool.mark_cached(request.block_ids[b], hashes[b])
        known[:] = hashes

    def free(self, request: Request) -> None:
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        self._hashes.pop(request.request_id, None)
