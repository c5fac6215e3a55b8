"""Prefix-cache keys: a SHA-256 chain over (parent key, token ids), salted with the model identity."""

from __future__ import annotations

import hashlib
from array import array

from specserve.engine.kv_cache_manager import KVCacheManager, hash_block_tokens, root_block_hash
from specserve.engine.request import Request
from specserve.engine.sampling_params import SamplingParams

BLOCK = 4


def _computed(manager: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """Admit a request, 'run' its whole prompt and publish its full blocks, as the engine does."""
    request = Request(rid, tokens, SamplingParams(temperature=0))
    request.num_computed_tokens = request.num_cached_prompt_tokens = manager.reuse_cached_prefix(request)
    assert manager.allocate_slots(request, len(tokens) - request.num_computed_tokens)
    request.num_computed_tokens = len(tokens)
    manager.cache_computed_blocks(request)
    return request


def _chain(salt: str, tokens: list[int]) -> list[bytes]:
    """The documented encoding, spelled out: sha256(parent digest || token ids as native int64)."""
    keys, parent = [], hashlib.sha256(b"specserve prefix cache v1\0" + salt.encode()).digest()
    for b in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + array("q", tokens[b * BLOCK : (b + 1) * BLOCK]).tobytes()).digest()
        keys.append(parent)
    return keys


def test_published_blocks_are_keyed_by_the_sha256_chain():
    manager = KVCacheManager(16, BLOCK, enable_prefix_caching=True, cache_salt="target|draft")
    tokens = list(range(100, 110))  # two full blocks and a partial one
    request = _computed(manager, "a", tokens)
    keys = _chain("target|draft", tokens)
    assert [len(k) for k in keys] == [32, 32]
    assert [manager.pool.lookup(k) for k in keys] == request.block_ids[:2]


def test_chain_same_prefix_same_key_and_parent_and_salt_change_it():
    root = root_block_hash("m")
    block = [1, 2, 3, 4]
    assert hash_block_tokens(root, block) == hash_block_tokens(root_block_hash("m"), list(block))
    assert hash_block_tokens(root, block) != hash_block_tokens(root, [1, 2, 3, 5])
    assert hash_block_tokens(root, block) != hash_block_tokens(hash_block_tokens(root, block), block)
    assert hash_block_tokens(root, block) != hash_block_tokens(root_block_hash("other model"), block)


def test_equal_later_blocks_after_a_different_first_block_do_not_hit():
    manager = KVCacheManager(16, BLOCK, enable_prefix_caching=True)
    _computed(manager, "a", [1, 2, 3, 4, 9, 9, 9, 9, 0])
    b = _computed(manager, "b", [5, 6, 7, 8, 9, 9, 9, 9, 0])
    assert b.num_cached_prompt_tokens == 0 and manager.pool.num_hits == 0
    c = Request("c", [1, 2, 3, 4, 9, 9, 9, 9, 1], SamplingParams(temperature=0))
    assert manager.reuse_cached_prefix(c) == 2 * BLOCK  # the same prefix does hit


def test_blocks_whose_python_hash_collides_are_not_shared():
    """hash() is not injective (hash(2**61 - 1) == hash(0)), so the old keys let request b read a's KV.

    Python does not randomise int hashing, so collisions between real token blocks can be searched
    for offline; this one is just the quickest to write down.
    """
    assert hash((0, (2**61 - 1, 0, 0, 0))) == hash((0, (0, 0, 0, 0)))
    manager = KVCacheManager(16, BLOCK, enable_prefix_caching=True)
    _computed(manager, "a", [0, 0, 0, 0, 1])
    b = Request("b", [2**61 - 1, 0, 0, 0, 1], SamplingParams(temperature=0))
    assert manager.reuse_cached_prefix(b) == 0


def test_blocks_published_step_by_step_get_the_same_keys_as_at_once():
    tokens = list(range(30, 43))
    stepwise = KVCacheManager(16, BLOCK, enable_prefix_caching=True)
    request = Request("a", tokens[:5], SamplingParams(temperature=0, max_tokens=20))
    assert stepwise.allocate_slots(request, len(tokens))
    for n in range(5, len(tokens) + 1):  # decode: one token at a time
        request.output_token_ids = tokens[5:n]
        request.num_computed_tokens = n
        stepwise.cache_computed_blocks(request)
    assert [stepwise.pool.lookup(k) for k in _chain("", tokens)] == request.block_ids[:3]
