"""Where the block pool places a request's KV blocks: consecutive runs at the lowest free ids, growth in
place, prefix-cached blocks evicted only when nothing else is free. No torch, no model."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from specserve.engine.block_pool import MAX_GROWTH_ROOM, BlockPool
from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request
from specserve.engine.sampling_params import SamplingParams


def _runs(ids: list[int]) -> int:
    """Maximal runs of consecutive ids in a block table (1 = fully consecutive)."""
    return 1 + sum(b != a + 1 for a, b in pairwise(ids))


def test_interleaved_requests_each_grow_in_their_own_run():
    """Eight requests admitted one after the other, then growing a block at a time in turn (decode):
    each keeps one run of consecutive ids, because each fresh run leaves its expected growth free."""
    block = 4
    kv = KVCacheManager(num_blocks=1024, block_size=block, enable_prefix_caching=False)
    requests = [
        Request(f"r{i}", list(range(10 + 3 * i)), SamplingParams(max_tokens=24, temperature=0))
        for i in range(8)
    ]
    for r in requests:
        assert kv.allocate_slots(r, len(r.prompt_token_ids))
        r.num_computed_tokens = len(r.prompt_token_ids)
    for _ in range(24):  # every request decodes one token a step
        for r in requests:
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
    for r in requests:
        assert len(r.block_ids) == -(-(len(r.prompt_token_ids) + 24) // block)
        assert _runs(r.block_ids) == 1, r.block_ids
    held = sorted(b for r in requests for b in r.block_ids)
    assert len(set(held)) == len(held)


def test_without_placement_hints_the_same_interleaving_scatters():
    """The test above is not vacuous: allocated without `after` and `growth` (as the pool used to be
    asked), the same interleaving puts every request's growth blocks away from its prompt's."""
    pool = BlockPool(1024, enable_caching=False)
    tables = [pool.allocate(3) for _ in range(8)]
    for _ in range(6):
        for table in tables:
            table += pool.allocate(1)
    assert all(_runs(table) > 1 for table in tables)


def test_a_fresh_run_takes_the_lowest_free_ids_that_fit():
    pool = BlockPool(64, enable_caching=False)
    first = pool.allocate(4)  # 0..3
    second = pool.allocate(4)  # room of 0 asked: 4..7
    assert first == [0, 1, 2, 3] and second == [4, 5, 6, 7]
    pool.free(first[::-1])
    assert pool.allocate(3) == [0, 1, 2]  # the hole first, not unused ids further on
    assert pool.allocate(2) == [8, 9]  # one block left at 3 cannot hold two consecutive blocks


def test_growth_room_is_left_after_a_run_and_before_it():
    pool = BlockPool(256, enable_caching=False)
    a = pool.allocate(2, growth=4)  # pool empty: starts at 0, room 2..5 stays free
    b = pool.allocate(2, growth=4)  # leaves a's room (4 blocks) before itself
    assert a == [0, 1] and b == [6, 7]
    assert pool.allocate(3, after=a[-1]) == [2, 3, 4]  # a grows in place
    # Room is capped: a request expecting to grow without bound does not push others away forever.
    c = pool.allocate(1, growth=10_000)
    assert c[0] - (b[-1] + 1) == MAX_GROWTH_ROOM


def test_growth_continues_elsewhere_when_the_next_block_is_taken():
    pool = BlockPool(32, enable_caching=False)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert b[0] == a[-1] + 1
    grown = pool.allocate(3, after=a[-1])  # 2 is b's: a fresh run of three instead
    assert grown == [4, 5, 6]
    more = pool.allocate(2, after=grown[-1])
    assert more == [7, 8]


def test_a_fragmented_pool_still_hands_out_every_free_block():
    pool = BlockPool(16, enable_caching=False)
    held = pool.allocate(16)
    pool.free(held[::2])  # every other block free: no run of two anywhere
    got = pool.allocate(5, growth=3)
    assert got == [0, 2, 4, 6, 8]  # the lowest free ones
    assert pool.num_free_blocks == 3
    with pytest.raises(MemoryError):
        pool.allocate(4)
    assert pool.num_free_blocks == 3  # a refused allocation takes nothing


def test_cached_blocks_are_evicted_last_oldest_first_and_come_back_ascending():
    pool = BlockPool(8, enable_caching=True)
    old = pool.allocate(3)  # 0..2
    new = pool.allocate(3)  # 3..5
    for i, b in enumerate(old + new):
        pool.mark_cached(b, block_hash=bytes([i]) * 32)
    pool.free(old[::-1])  # tail first, as the KV cache manager frees
    pool.free(new[::-1])
    # Two blocks (6, 7) hold nothing: they go first, then the least recently freed cached blocks,
    # the old request's tail before its head, handed out in ascending order.
    got = pool.allocate(4)
    assert got == [6, 7, 1, 2]
    assert pool.lookup(bytes([0]) * 32) == 0  # the old request's first block is still cached
    assert pool.lookup(bytes([2]) * 32) is None  # its tail was evicted
    assert pool.lookup(bytes([3]) * 32) == 3


def test_a_free_block_cannot_be_published():
    pool = BlockPool(4, enable_caching=True)
    with pytest.raises(RuntimeError, match="free"):
        pool.mark_cached(0, block_hash=b"\0" * 32)


def test_steady_churn_keeps_the_working_set_low_and_every_table_mostly_consecutive():
    """Requests of random sizes come and go, eight at a time, growing a token at a time in random
    order (about 180 of them): the pool never reaches far beyond the most blocks held at once, and
    the block tables stay close to one run (without the hints: 7.8 runs a table)."""
    rng = random.Random(7)
    block = 16
    kv = KVCacheManager(num_blocks=4096, block_size=block, enable_prefix_caching=False)
    live: list[tuple[Request, int]] = []
    highest = most_held = 0
    runs: list[int] = []
    for n in range(20_000):
        while len(live) < 8:
            prompt, out = rng.randint(20, 500), rng.randint(8, 200)
            r = Request(
                f"r{n}-{len(live)}", list(range(prompt)), SamplingParams(max_tokens=out, temperature=0)
            )
            assert kv.allocate_slots(r, prompt)
            r.num_computed_tokens = prompt
            live.append((r, out))
        most_held = max(most_held, kv.pool.num_blocks - kv.num_free_blocks)
        r, out = rng.choice(live)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        if r.num_computed_tokens >= len(r.prompt_token_ids) + out:
            runs.append(_runs(r.block_ids))
            highest = max(highest, *r.block_ids)
            kv.free(r)
            live.remove((r, out))
    assert len(runs) > 150
    assert highest < 2 * most_held  # 350 against 229 held
    assert sum(x == 1 for x in runs) / len(runs) > 0.75  # 0.88
    assert sum(runs) / len(runs) < 1.5  # 1.12
