"""The official openai client (sync and async) against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import openai
import pytest

from specserve.engine.sampling_params import MAX_NUM_SPECULATIVE_TOKENS


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_streaming_matches_non_streaming(client):
    kwargs = dict(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_continuous_usage_counts_every_chunks_tokens(client):
    """vLLM's stream_options.continuous_usage_stats: usage so far on every chunk, summed over choices,
    ending at the final usage (a client counts the tokens each chunk carried from the differences)."""
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=9,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    content = [c for c in chunks if c.choices]
    assert content and all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[0] >= 1
    assert counts[-1] == chunks[-1].usage.completion_tokens == 18  # two choices of 9
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_usage_only_at_the_end_without_continuous_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "continuous_usage_stats needs stream_options.include_usage",
        ),
    ],
)
def test_contradictory_stream_options_are_400s(client, extra, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
    assert message in str(err.value) and err.value.body["param"] == "stream_options"


def test_chat_streaming(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_choices(client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_seed_reproducible(client):
    kwargs = dict(model="tiny", prompt="Bonjour", max_tokens=10, temperature=1.0, seed=42)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_stop_string(client):
    base = (
        client.completions.create(
            model="tiny", prompt="The quick", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = base[4:7]
    assert stop
    r = client.completions.create(
        model="tiny",
        prompt="The quick",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    c = client.completions.create(
        model="tiny", prompt="x", max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert len(c.choices[0].logprobs.token_logprobs) == 3


def test_speculative_extension(client):
    prompt = "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9 10 11 12 1 2 3"
    on = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 3, "policy": "static"}},
    )
    off = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "speculative": {"enabled": False}},
    )
    assert on.choices[0].text == off.choices[0].text  # lossless
    spec_on = on.usage.model_extra["speculative"]
    spec_off = off.usage.model_extra["speculative"]
    assert spec_on["num_draft_tokens"] > 0
    assert 0 <= spec_on["acceptance_rate"] <= 1
    assert spec_on["mean_acceptance_length"] >= 1
    assert 2 <= spec_on["mean_k"] <= 3  # static: the cap, less only where few tokens are left
    assert spec_off["num_draft_tokens"] == 0
    assert spec_off["mean_k"] == 0
    adaptive = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "speculative": {"policy": "adaptive"}},
    )
    assert adaptive.choices[0].text == off.choices[0].text
    assert 0 <= adaptive.usage.model_extra["speculative"]["mean_k"] <= MAX_NUM_SPECULATIVE_TOKENS
    with pytest.raises(openai.BadRequestError, match="policy"):
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, extra_body={"speculative": {"policy": "greedy"}}
        )


async def test_async_client_concurrent(server):
    client = openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)
    results = await asyncio.gather(
        *[
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=6, temperature=0
            )
            for i in range(6)
        ]
    )
    assert all(r.choices[0].message.content is not None for r in results)
    await client.close()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
