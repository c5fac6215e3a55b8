"""Block pool, KV cache manager and scheduler, without torch or a model."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import FinishReason, Request
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler, SchedulerConfig


def _req(rid: str, n_prompt: int, max_tokens: int = 8, first: int = 0) -> Request:
    return Request(
        rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0)
    )


def _make(num_blocks=64, block=4, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block, cfg.pop("prefix", False))
    return Scheduler(SchedulerConfig(**{"max_length": 256, **cfg}), kv)


def _advance(s: Scheduler, out, new_token: int = 7, accepted: int = 0) -> None:
    """What the engine does after a step: commit computed tokens and append sampled ones."""
    for item in out.scheduled:
        r = item.request
        sampled = r.num_computed_tokens + item.num_new_tokens == r.num_tokens
        r.num_computed_tokens += item.num_new_tokens
        if sampled:
            r.num_computed_tokens += min(accepted, item.num_speculative_tokens)
            r.output_token_ids += [new_token] * (1 + min(accepted, item.num_speculative_tokens))
        s.kv.cache_computed_blocks(r)


def test_scheduling_modules_import_no_torch():
    """The scheduler and the KV bookkeeping are pure Python: check their own imports."""
    import ast
    from pathlib import Path

    import specserve.engine.scheduler as scheduler_module

    engine_dir = Path(scheduler_module.__file__).parent
    for name in [
        "scheduler",
        "spec_controller",
        "acceptance_model",
        "step_cost_model",
        "catch_up_payback",
        "kv_cache_manager",
        "block_pool",
        "request",
        "stats",
        "sampling_params",
    ]:
        tree = ast.parse((engine_dir / f"{name}.py").read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert "torch" not in imported, name


def test_admission_respects_token_budget_and_batch_size():
    s = _make(max_num_batched_tokens=10, max_batch_size=2)
    for i in range(3):
        s.add_request(_req(f"r{i}", 4))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]  # batch size 2
    assert sum(x.num_new_tokens for x in out.scheduled) <= 10


def test_chunked_prefill_splits_long_prompt():
    s = _make(max_num_batched_tokens=8, enable_chunked_prefill=True)
    s.add_request(_req("long", 20))
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        _advance(s, out)
    assert chunks == [8, 8, 4]
    assert s.running[0].output_token_ids == [7]


def test_without_chunking_a_prompt_waits_for_a_whole_step():
    s = _make(max_num_batched_tokens=12, enable_chunked_prefill=False)
    s.add_request(_req("a", 8))
    s.add_request(_req("b", 8))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 8)]
    _advance(s, out)
    out = s.schedule()  # a decodes (1 token) and b's whole prompt fits now
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 8)]


def test_lookahead_slots_reserved_for_drafts():
    s = _make(num_speculative_tokens=3, block=4)
    s.add_request(_req("a", 4, max_tokens=20))
    _advance(s, s.schedule())
    out = s.schedule()
    item = out.scheduled[0]
    assert (item.num_new_tokens, item.num_speculative_tokens) == (1, 3)
    r = item.request
    # computed 4 + 1 new + 3 lookahead = 8 slots -> 2 blocks of 4
    assert len(r.block_ids) == 2


def test_lookahead_never_exceeds_max_tokens_left():
    s = _make(num_speculative_tokens=5)
    s.add_request(_req("a", 4, max_tokens=3))
    _advance(s, s.schedule())  # 1 token generated, 2 left -> at most 1 draft
    assert s.schedule().scheduled[0].num_speculative_tokens == 1


def test_preemption_takes_newest_and_requeues_it_first():
    s = _make(num_blocks=6, block=4, max_num_batched_tokens=64)
    s.add_request(_req("old", 8, max_tokens=40))
    s.add_request(_req("new", 8, max_tokens=40, first=100))
    _advance(s, s.schedule())  # both prefilled: 2 blocks each + room
    preempted = []
    for _ in range(12):
        out = s.schedule()
        preempted += [r.request_id for r in out.preempted]
        _advance(s, out)
    assert preempted and preempted[0] == "new"
    new = next(r for r in list(s.waiting) + s.running if r.request_id == "new")
    assert new.num_preemptions >= 1


def test_abort_frees_everything():
    s = _make(num_blocks=16)
    a, b = _req("a", 10), _req("b", 10)
    s.add_request(a)
    s.add_request(b)
    _advance(s, s.schedule())
    s.add_request(c := _req("c", 5))
    s.finish(a, FinishReason.ABORT)
    s.finish(c, FinishReason.ABORT)  # waiting or running, it goes
    s.finish(b, FinishReason.ABORT)
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 16


def test_prefix_cache_hit_reuses_blocks():
    s = _make(num_blocks=32, block=4, prefix=True)
    a = _req("a", 13, max_tokens=1)
    s.add_request(a)
    _advance(s, s.schedule())
    s.finish(a, FinishReason.STOP)
    b = _req("b", 13, max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    # 3 full blocks (12 tokens) reused; only the last token is computed.
    assert b.num_cached_prompt_tokens == 12
    assert out.scheduled[0].num_new_tokens == 1
    assert s.kv.pool.num_hits == 3


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(1, 40), st.integers(0, 3)
        ),
        min_size=5,
        max_size=80,
    ),
    chunked=st.booleans(),
    prefix=st.booleans(),
    num_blocks=st.integers(12, 40),
)
# Without chunked prefill a waiting request whose prompt did not fit the step's budget kept the prefix
# blocks it had just reused (blocks 0-1 of r0's prompt) while it waited.
@example(
    ops=[("add", 8, 0), ("step", 1, 0), ("add", 22, 0), ("add", 32, 0), ("step", 1, 0)],
    chunked=False,
    prefix=True,
    num_blocks=12,
)
def test_random_operations_keep_invariants(ops, chunked, prefix, num_blocks):
    s = _make(
        num_blocks=num_blocks,
        block=4,
        prefix=prefix,
        max_num_batched_tokens=48,
        max_batch_size=4,
        enable_chunked_prefill=chunked,
        max_length=44,
        num_speculative_tokens=2,
    )
    live: list[Request] = []
    n = 0
    for op, size, accepted in ops:
        if op == "add":
            r = _req(f"r{n}", min(size, 36), max_tokens=4, first=size % 3)
            n += 1
            s.add_request(r)
            live.append(r)
        elif op == "abort" and live:
            r = live.pop(size % len(live))
            s.finish(r, FinishReason.ABORT)
        else:
            out = s.schedule()
            _advance(s, out, accepted=accepted)
            for r in list(s.running):
                if len(r.output_token_ids) >= 4:
                    s.finish(r, FinishReason.LENGTH)
                    live.remove(r)
        # Invariants: a block is held by as many requests as its ref count says; no block is both free
        # and held; running requests hold enough blocks for their computed tokens.
        held: dict[int, int] = {}
        for r in s.running:
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
            assert len(r.block_ids) * 4 >= r.num_computed_tokens
        for r in s.waiting:
            assert not r.block_ids
        for b in s.kv.pool.blocks:
            assert b.ref_count == held.get(b.block_id, 0)
        assert s.kv.num_free_blocks == sum(1 for b in s.kv.pool.blocks if b.ref_count == 0)
    for r in live:
        s.finish(r, FinishReason.ABORT)
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == num_blocks


def test_speculation_pauses_for_large_batches():
    s = _make(num_speculative_tokens=3, speculative_disable_batch_size=2)
    s.add_request(_req("a", 4, max_tokens=20))
    _advance(s, s.schedule())
    assert s.schedule().scheduled[0].num_speculative_tokens == 3  # alone: drafts
    s.add_request(_req("b", 4, max_tokens=20, first=50))
    out = s.schedule()
    _advance(s, out)
    out = s.schedule()  # two running: at the limit, no drafts for anyone
    assert [x.num_speculative_tokens for x in out.scheduled] == [0, 0]


def test_freed_blocks_without_cached_content_are_reused_first():
    """A server under steady load keeps touching the same few blocks, not the whole pool in turn."""
    from specserve.engine.block_pool import BlockPool

    pool = BlockPool(100, enable_caching=True)
    first = pool.allocate(3)
    for _ in range(5):  # request after request of the same size: the same blocks every time
        pool.free(first)
        again = pool.allocate(3)
        assert sorted(again) == sorted(first)
        first = again
    # A block with cached content waits at the back of the queue for a prefix hit instead.
    pool.mark_cached(first[0], block_hash=1234)
    pool.free(first)
    reused = pool.allocate(2)
    assert first[0] not in reused and sorted(reused) == sorted(first[1:])
    assert pool.lookup(1234) == first[0]
