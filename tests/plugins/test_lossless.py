"""Speculative decoding is lossless: greedy output equals plain greedy output token for token, and
sampled output follows the same distribution."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, make_adaptive_llm, make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.config import EngineConfig, ModelSpec
from specserve.engine.proposer import ProposerError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(16, seed=1)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir)
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)]


def _method_kwargs(method, request, draft="tiny_draft_dir"):
    if method == "draft_model":
        return {
            "speculative_method": "draft_model",
            "draft_model_path": str(request.getfixturevalue(draft)),
        }
    if method == "medusa":
        return {
            "speculative_method": "medusa",
            "medusa_heads_path": str(request.getfixturevalue("medusa_heads_dir")),
        }
    if method in ("eagle", "eagle-vocab"):
        fixture = "eagle_head_dir" if method == "eagle" else "eagle_vocab_head_dir"
        return {
            "speculative_method": "eagle",
            "speculative_head_path": str(request.getfixturevalue(fixture)),
        }
    if method == "toy":
        return {"speculative_method": request.getfixturevalue("toy_plugin_entry_point")}
    if method == "bigram":
        return {"speculative_method": request.getfixturevalue("example_plugin_entry_point")}
    if method == "ngram,draft_model":
        return {
            "speculative_method": method,
            "draft_model_path": str(request.getfixturevalue(draft)),
        }
    return {"speculative_method": method}


def _build(policy, model_dir, slope=0.1, **kwargs):
    """static: the proposer drafts k every step; adaptive: the controller picks k per request per step
    (on a fixed cost slope: a batch of 64 needs a flatter one than 16 for drafting to pay)."""
    if policy == "adaptive":
        return make_adaptive_llm(model_dir, slope=slope, **kwargs)
    return make_llm(model_dir, **kwargs)


def _check_k_varied(llm, policy):
    if policy == "adaptive":  # the point of the adaptive arm: k differed between requests/steps
        assert len(set(llm.engine.stats.events.chosen_k)) >= 2


@pytest.mark.parametrize("policy", ["static", "adaptive"])
@pytest.mark.parametrize(
    "method", ["ngram", "draft_model", "medusa", "eagle", "eagle-vocab", "toy", "bigram", "ngram,draft_model"]
)
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 48},
        {"enable_chunked_prefill": False},
        {"max_kv_cache_tokens": 224, "max_length": 96},  # forced preemption
        {"enable_prefix_caching": True, "block_size": 4, "max_num_batched_tokens": 48},
    ],
    ids=["chunked", "unchunked", "preempting", "prefix-cached"],
)
def test_greedy_speculation_equals_plain(
    tiny_llama_dir, prompts, plain, method, engine_kwargs, policy, request
):
    llm = _build(
        policy, tiny_llama_dir, num_speculative_tokens=4, **engine_kwargs, **_method_kwargs(method, request)
    )
    outs = llm.generate(prompts, GREEDY, use_chat_template=False)
    assert [o.token_ids for o in outs] == plain
    if engine_kwargs.get("enable_prefix_caching"):
        # Again, now that the cache is warm: requests start from cached blocks (also for the draft's KV).
        again = llm.generate(prompts[:6], GREEDY, use_chat_template=False)
        assert [o.token_ids for o in again] == plain[:6]
        assert llm.engine.kv_manager.pool.num_hits > 0
    spec = llm.engine.stats.spec
    assert spec.num_draft_tokens > 0, "the proposer never proposed"
    if "max_kv_cache_tokens" in engine_kwargs:
        assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    _check_k_varied(llm, policy)


def test_target_as_its_own_draft_accepts_everything(tiny_llama_dir, prompts, plain):
    llm = make_llm(tiny_llama_dir, draft_model_path=str(tiny_llama_dir), speculative_method="draft_model")
    outs = llm.generate(prompts, GREEDY, use_chat_template=False)
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.stats.spec.acceptance_rate == 1.0
    assert all(o.spec.acceptance_rate == 1.0 for o in outs)


def test_per_request_speculation_control(tiny_llama_dir, prompts, plain):
    llm = make_llm(tiny_llama_dir, speculative_method="ngram")
    off = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculative_enabled=False)
    two = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=2)
    outs = llm.generate(prompts[:2], [off, two], use_chat_template=False)
    assert [o.token_ids for o in outs] == plain[:2]
    assert outs[0].spec.num_draft_tokens == 0
    assert all(len(p) <= 2 for p in [outs[1].spec.accepted_per_position])


def _chi_square_p_value(a: list[tuple], b: list[tuple]) -> float:
    """Chi-square test of homogeneity between two samples of categorical outcomes."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    # Merge rare categories (expected count < 5) into one so the chi-square approximation holds.
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    rare = expected.min(0).values < 5
    if rare.any():
        counts = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], dim=1)
        expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize(
    ("method", "policy"),
    [
        ("draft_model", "static"),
        ("ngram", "static"),
        ("bigram", "static"),
        ("eagle", "static"),
        ("eagle-vocab", "static"),
        ("draft_model", "adaptive"),
        ("ngram", "adaptive"),
        ("ngram,draft_model", "adaptive"),
    ],
)
def test_sampled_sequences_follow_target_distribution(
    tiny_llama_dir, tiny_draft_dir, method, policy, request
):
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    n = 1500
    params = [
        SamplingParams(max_tokens=5, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(n)
    ]
    base = make_llm(tiny_llama_dir, max_batch_size=64)
    # The adaptive controller rightly stops drafting with tiny_draft_dir here (it is accepted ~5% of
    # the time, never at the first position): give it a draft it keeps using.
    draft = "tiny_close_draft_dir" if policy == "adaptive" else "tiny_draft_dir"
    kwargs = {**_method_kwargs(method, request, draft), "num_speculative_tokens": 3, "max_batch_size": 64}
    spec = _build(policy, tiny_llama_dir, slope=0.01, **kwargs)
    a = [tuple(o.token_ids) for o in base.generate([prompt] * n, params, use_chat_template=False)]
    # Different seeds for the speculative run: independent samples, not the same random stream.
    params_b = [
        SamplingParams(max_tokens=5, temperature=1.0, top_k=3, seed=n + i, ignore_eos=True) for i in range(n)
    ]
    b = [tuple(o.token_ids) for o in spec.generate([prompt] * n, params_b, use_chat_template=False)]
    assert spec.engine.stats.spec.num_draft_tokens > 0
    assert 0 < spec.engine.stats.spec.acceptance_rate < 1  # real rejections happened
    _check_k_varied(spec, policy)
    if policy == "adaptive" and "draft_model" in method:  # sampled drafts end where their chain is unsure
        assert any(s.draft_tokens < s.window_tokens for s in spec.engine.stats.events.steps)
    # First tokens: a sharper check on a small space; whole 5-token sequences: the joint law.
    assert _chi_square_p_value([s[:1] for s in a], [s[:1] for s in b]) > 0.001
    assert _chi_square_p_value([s[:2] for s in a], [s[:2] for s in b]) > 0.001
    assert _chi_square_p_value(a, b) > 0.001


def test_mismatched_draft_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    build_tiny_model(tmp_path, "llama", seed=2, vocab_size=300)
    with pytest.raises(ProposerError, match="vocabulary"):
        make_llm(tiny_llama_dir, draft_model_path=str(tmp_path), speculative_method="draft_model")


def test_unknown_method_lists_choices(tiny_llama_dir):
    with pytest.raises(ProposerError, match="ngram"):
        make_llm(tiny_llama_dir, speculative_method="no_such_method")


def test_unknown_method_is_refused_before_any_model_loads():
    """The config checks the names against the installed proposers; a model that does not exist is
    never reached. package.module:Class is imported only when the engine builds it."""
    config = EngineConfig(model=ModelSpec("/no/such/model"), speculative_method="ngram,no_such_method")
    with pytest.raises(ProposerError, match="'no_such_method'; choose auto, none, .*ngram"):
        config.validate()
    EngineConfig(model=ModelSpec("/no/such/model"), speculative_method="ngram,no_such.module:Cls").validate()


def test_stops_and_logprobs_inside_accepted_windows(tiny_llama_dir, tiny_draft_dir, prompts, plain):
    """A stop token, max_tokens or a stop string landing mid-window cuts it exactly where plain decoding stops."""
    base = make_llm(tiny_llama_dir)
    spec = make_llm(tiny_llama_dir, draft_model_path=str(tiny_draft_dir), speculative_method="draft_model")
    for i in (1, 3, 5):
        ref = plain[i]
        stop_id = ref[7]
        for params in (
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id], logprobs=2),
            SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=2),
        ):
            a = base.generate([prompts[i]], params, use_chat_template=False)[0]
            b = spec.generate([prompts[i]], params, use_chat_template=False)[0]
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
        text = base.generate([prompts[i]], GREEDY, use_chat_template=False)[0].text
        if len(text) > 8:
            stop = text[5:8]
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
            a = base.generate([prompts[i]], params, use_chat_template=False)[0]
            b = spec.generate([prompts[i]], params, use_chat_template=False)[0]
            assert b.text == a.text == text[: text.index(stop)]
    assert spec.engine.stats.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "ngram,draft_model"])
def test_windows_that_end_where_the_draft_is_unsure_equal_plain(
    tiny_llama_dir, prompts, plain, method, request
):
    """The adaptive controller raises a draft model's k to the cap and the draft ends each window
    after the draft at which its own chain probability falls below the controller's break-even
    (Decision.stop_below): greedy output still equals plain, token for token, with windows of every
    length."""
    kwargs = _method_kwargs(method, request, "tiny_close_draft_dir")
    llm = _build("adaptive", tiny_llama_dir, num_speculative_tokens=6, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_chat_template=False)
    assert [o.token_ids for o in outs] == plain
    steps = [s for s in llm.engine.stats.events.steps if s.window_tokens]
    assert any(s.draft_tokens < s.window_tokens for s in steps), "no window ended unsure"
    assert any(s.draft_tokens == s.window_tokens for s in steps), "every window ended unsure"
    assert all(s.draft_tokens <= s.window_tokens for s in steps)
