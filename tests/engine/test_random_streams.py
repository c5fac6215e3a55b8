"""Seeded randomness is keyed on (seed, output position, purpose), so a seeded request's text does not
depend on the load it ran under: unit checks of the streams, the rejection sampler's use of them, and
the engine end to end."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.random_streams import Purpose, RequestRandom
from specserve.engine.rejection_sampler import rejection_sample

# --- the streams ------------------------------------------------------------------------------------


def test_values_are_a_pure_function_of_seed_position_and_purpose():
    a, b = RequestRandom(1234), RequestRandom(1234)
    for position in (0, 1, 7, 10_000):
        for purpose in Purpose:
            assert a.key(position, purpose) == b.key(position, purpose)
            assert a.uniform(position, purpose) == b.uniform(position, purpose)
    keys = {
        RequestRandom(seed).key(position, purpose)
        for seed in (0, 1, 2, -1, 2**63)
        for position in range(200)
        for purpose in Purpose
    }
    assert len(keys) == 5 * 200 * len(Purpose)  # every (seed, position, purpose) differs


def test_values_are_stable_across_processes():
    # Pinned: a change here silently changes every seeded request's text (and must be deliberate).
    assert RequestRandom(0).key(0, Purpose.SAMPLE) == 0xB382A305F4414F5E
    assert RequestRandom(42).key(3, Purpose.ACCEPT) == 0xB7ABB011B5A21848
    assert RequestRandom(-5).key(2, Purpose.DRAFT) == RequestRandom(2**64 - 5).key(
        2, Purpose.DRAFT
    )  # mod 2^64


def test_draw_order_does_not_matter():
    stream = RequestRandom(7)
    cells = [(p, purpose) for p in range(50) for purpose in Purpose]
    in_order = {c: stream.uniform(*c) for c in cells}
    shuffled = cells[:]
    random.Random(0).shuffle(shuffled)
    probs = torch.softmax(torch.randn(32, generator=torch.Generator().manual_seed(0)), 0)
    for c in shuffled:
        stream.sample(probs, *c)  # interleaved draws of another kind change nothing either
        assert RequestRandom(7).uniform(*c) == in_order[c]
    assert [stream.sample(probs, p, Purpose.SAMPLE) for p in range(50)] == [
        RequestRandom(7).sample(probs, p, Purpose.SAMPLE) for p in reversed(range(50))
    ][::-1]


def test_uniforms_and_samples_have_the_right_law():
    stream = RequestRandom(3)
    u = torch.tensor([stream.uniform(p, Purpose.ACCEPT) for p in range(20_000)], dtype=torch.float64)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])  # zero-probability tokens are never drawn
    draws = torch.tensor([stream.sample(probs, p, Purpose.SAMPLE) for p in range(20_000)])
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    assert freq[1] == 0 and freq[4] == 0
    assert 0.5 * (freq - probs).abs().sum() < 0.01


def test_sample_at_the_top_of_the_unit_interval(monkeypatch):
    # u * total can round up to total: the draw is then the last token with mass, never out of range.
    monkeypatch.setattr(RequestRandom, "uniform", lambda self, position, purpose: 1.0 - 2.0**-53)
    assert RequestRandom(0).sample(torch.tensor([0.25, 0.75, 0.0, 0.0]), 0, Purpose.SAMPLE) == 1
    assert RequestRandom(0).sample(torch.tensor([1e-30, 1.0]), 0, Purpose.SAMPLE) == 1


def test_negative_position_is_refused():
    with pytest.raises(ValueError, match="position"):
        RequestRandom(0).key(-1, Purpose.DRAFT)


# --- the rejection sampler --------------------------------------------------------------------------


def _target(seed: int, rows: int, vocab: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g) * 1.5, dim=-1)  # [rows, V]


def _plain(p: torch.Tensor, stream: RequestRandom, position: int) -> int:
    """What plain decoding (a window without drafts) emits at `position` from distribution p."""
    return rejection_sample(
        p[None], torch.zeros(0, dtype=torch.long), None, [0], [False], [stream], [position]
    )[0][0]


def test_certain_drafts_emit_exactly_the_plain_samples():
    """One-hot drafts (n-gram, argmax): the emitted tokens are the ones plain decoding draws at those
    positions, accepted or not. A shared generator consumed acceptance uniforms first, so they differed."""
    num_accepted = 0
    for seed in range(300):
        p = _target(seed, 4)  # p_0..p_3
        drafts = p[:3].argmax(-1)  # likely, not certain: accepted sometimes, rejected sometimes
        stream, p0 = RequestRandom(seed), seed % 17
        out = rejection_sample(p, drafts, None, [3], [False], [stream], [p0])[0]
        assert out == [_plain(p[i], stream, p0 + i) for i in range(len(out))]
        num_accepted += len(out) - 1
    assert 0 < num_accepted < 3 * 300


def test_certain_drafts_are_accepted_with_probability_p():
    """Drawing the target's token first keeps the acceptance rate min(1, p(d) / 1) = p(d)."""
    p = _target(5, 2)
    draft = int(p[0].argmax())
    n = 20_000
    out = rejection_sample(
        p.repeat(n, 1),
        torch.full((n,), draft),
        None,
        [1] * n,
        [False] * n,
        [RequestRandom(i) for i in range(n)],
        [0] * n,
    )
    rate = sum(len(o) == 2 for o in out) / n
    assert abs(rate - float(p[0, draft])) < 0.015


def test_drafts_past_the_first_rejection_change_nothing():
    """A sampled draft's window emits the same tokens whatever follows its first rejection (k was cut
    by load, the proposer guessed further): with one generator, the extra acceptance draws moved the
    recovered token's sample."""
    compared = 0
    for seed in range(300):
        p = _target(seed, 4)
        q = _target(seed + 1000, 3)
        drafts = torch.stack(
            [torch.multinomial(q[i], 1, generator=torch.Generator().manual_seed(seed)) for i in range(3)]
        )[:, 0]
        stream = RequestRandom(seed)
        long = rejection_sample(p, drafts, q, [3], [False], [stream], [4])[0]
        short = rejection_sample(p[:2], drafts[:1], q[:1], [1], [False], [stream], [4])[0]
        if len(short) == 1:  # rejected at the first draft: the longer window must agree
            assert long == short
            compared += 1
    assert compared > 30


# --- the engine -------------------------------------------------------------------------------------


def _params(n: int, max_tokens: int = 20) -> list[SamplingParams]:
    return [
        # Sharp enough that n-gram drafts are sometimes accepted by the random tiny model.
        SamplingParams(max_tokens=max_tokens, temperature=0.7, top_k=4, seed=1000 + i, ignore_eos=True)
        for i in range(n)
    ]


def _tokens(llm, prompts, params, one_at_a_time: bool = False) -> list[list[int]]:
    if one_at_a_time:
        return [
            llm.generate([p], [sp], use_chat_template=False)[0].token_ids
            for p, sp in zip(prompts, params, strict=True)
        ]
    return [o.token_ids for o in llm.generate(prompts, params, use_chat_template=False)]


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(32, seed=3)  # half with repeats, so n-gram lookup finds drafts


@pytest.fixture(scope="module")
def plain_sampled(tiny_llama_dir, prompts):
    return _tokens(make_llm(tiny_llama_dir), prompts, _params(len(prompts)))


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"num_speculative_tokens": 4},
        {"num_speculative_tokens": 2, "max_batch_size": 5},
        {"num_speculative_tokens": 4, "max_kv_cache_tokens": 224, "max_length": 96},  # forced preemption
    ],
    ids=["k4", "k2-small-batches", "preempting"],
)
def test_ngram_speculation_gives_the_plain_text(tiny_llama_dir, prompts, plain_sampled, engine_kwargs):
    """n-gram drafts are certain (q one-hot), so every emitted token is the one plain decoding draws at
    its position: the seeded text equals speculation-off text, whatever k, batch or preemption. Fails
    with one generator per request (acceptance uniforms shift every later sample)."""
    llm = make_llm(tiny_llama_dir, speculative_method="ngram", **engine_kwargs)
    assert _tokens(llm, prompts, _params(len(prompts))) == plain_sampled
    assert llm.engine.stats.spec.num_accepted_tokens > 0
    if "max_kv_cache_tokens" in engine_kwargs:
        assert llm.engine.stats.num_preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_concurrency_does_not_change_seeded_text(tiny_llama_dir, tiny_draft_dir, prompts, method):
    """Fixed k: the same seeded requests one at a time and 32 at once give the same token ids."""
    kwargs = {"speculative_method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        kwargs["draft_model_path"] = str(tiny_draft_dir)
    llm = make_llm(tiny_llama_dir, **kwargs)
    params = _params(len(prompts), max_tokens=12)
    alone = _tokens(llm, prompts, params, one_at_a_time=True)
    assert _tokens(llm, prompts, params) == alone
    assert 0 < llm.engine.stats.spec.acceptance_rate < 1


@pytest.mark.xfail(
    strict=True,
    reason="known limit: under KV pressure the scheduler cuts a step's k to 0 and a preempted request"
    " resumes with a plain (draft-less) step; a sampled draft decides its position differently from a"
    " plain sample, so the text after that position is another exact sample. Flips when the scheduler"
    " keeps k on those steps.",
)
def test_sampled_drafts_under_kv_pressure(tiny_llama_dir, tiny_draft_dir, prompts):
    kwargs = {
        "speculative_method": "draft_model",
        "draft_model_path": str(tiny_draft_dir),
        "num_speculative_tokens": 4,
        "max_length": 96,
    }
    params = _params(16)
    ref = _tokens(make_llm(tiny_llama_dir, **kwargs), prompts[:16], params)
    llm = make_llm(tiny_llama_dir, max_kv_cache_tokens=224, **kwargs)
    got = _tokens(llm, prompts[:16], params)
    assert llm.engine.stats.num_preemptions > 0
    assert got == ref
