"""End to end on a tiny random model, greedy float32: batching never changes the tokens."""

from __future__ import annotations

import pytest
from tiny_models import make_llm, mixed_prompts

from specserve.engine import InvalidParameterError, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(16)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir)
    return [llm.generate([p], GREEDY, use_chat_template=False)[0].token_ids for p in prompts]


def _batched(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)]


@pytest.mark.parametrize("chunked", [True, False])
def test_batch_equals_alone(tiny_llama_dir, prompts, alone, chunked):
    llm = make_llm(
        tiny_llama_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=64 if chunked else None
    )
    assert _batched(llm, prompts) == alone
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_preemption_does_not_change_outputs(tiny_llama_dir, prompts, alone):
    # 12 blocks of 16 tokens cannot hold 16 running requests: preemption must happen.
    llm = make_llm(tiny_llama_dir, max_kv_cache_tokens=192, max_length=96)
    assert _batched(llm, prompts) == alone
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_prefix_caching_does_not_change_outputs(tiny_llama_dir, prompts, alone):
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=True, block_size=4)
    shared = [p for p in prompts] + [prompts[3]]  # a repeat hits the cache
    out = _batched(llm, shared)
    assert out[:-1] == alone and out[-1] == alone[3]
    out2 = _batched(llm, [prompts[5]])
    assert out2 == [alone[5]]
    assert llm.engine.kv_manager.pool.num_hits > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_seeded_sampling_is_independent_of_batch(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], params, use_chat_template=False)[0].token_ids
    mixed = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 5
    batch = llm.generate([*prompts[1:6], prompts[0]], [*mixed, params], use_chat_template=False)
    assert batch[-1].token_ids == alone
    unseeded = llm.generate(
        [prompts[0]] * 2, SamplingParams(max_tokens=16, temperature=1.0), use_chat_template=False
    )
    assert unseeded[0].token_ids != alone or unseeded[1].token_ids != alone


def test_stop_conditions(tiny_llama_dir, prompts, alone):
    llm = make_llm(tiny_llama_dir)
    ref = alone[1]
    stop_at = ref[5]
    out = llm.generate(
        [prompts[1]],
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at]),
        use_chat_template=False,
    )[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1] and out.finish_reason == "stop"
    out = llm.generate(
        [prompts[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_chat_template=False
    )[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length"


def test_stop_string_is_cut_from_text(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    full = llm.generate("The quick brown fox", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        "The quick brown fox", SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_logprobs_reported(tiny_llama_dir, prompts):
    llm = make_llm(tiny_llama_dir)
    out = llm.generate(
        [prompts[2]],
        SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True),
        use_chat_template=False,
    )[0]
    assert len(out.logprobs) == 4
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the chosen token is the most likely


def test_bad_requests_are_refused(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_length=64)
    with pytest.raises(InvalidParameterError) as err:
        llm.generate([list(range(3, 80))], SamplingParams(max_tokens=4))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as err:
        llm.generate([[5, 6]], SamplingParams(max_tokens=100))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidParameterError):
        SamplingParams(top_p=float("nan"))
