"""Logprobs of tokens that split a UTF-8 character: real bytes, and texts that join to the output.

The real server and the official openai client. logit_bias leaves the tiny model two tokens:
PREFIX (bytes e3 81, the start of の) `lead` ahead of TAIL (byte ae, which completes it), and a
frequency penalty of 2 hands the lead back and forth, so greedy output is PREFIX TAIL PREFIX ...:
"のの..." with every character split across two tokens. That needs 0 < lead + (raw PREFIX logit - raw
TAIL logit) < 2 at every step; along this path the tiny model's raw difference stays within
[-1.4, 0.1] after the chat prompt and [-0.9, 0.8] after the completion prompt, hence the leads.
"""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

PREFIX_BYTES, TAIL_BYTES = [0xE3, 0x81], [0xAE]
REPLACEMENT_BYTES = list("\ufffd".encode())  # [239, 191, 189]: what the bug reported
CHAT_LEAD, COMPLETION_LEAD = 1.7, 1.05


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def token_ids(tiny_llama_dir) -> tuple[int, int]:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prefix, tail = tok.convert_tokens_to_ids(["ãģ", "®"])  # byte-level spellings of e3 81 and ae
    assert tok.unk_token_id not in (prefix, tail)
    return prefix, tail


def _alternating(token_ids: tuple[int, int], lead: float) -> dict:
    """Request arguments whose greedy output alternates PREFIX and TAIL."""
    prefix, tail = token_ids
    return {
        "temperature": 0,
        "frequency_penalty": 2.0,
        "logit_bias": {str(prefix): 100, str(tail): 100 - lead},
        "max_tokens": 9,  # ends inside a character: that half is not in the text yet
    }


def _check(tokens: list[str], raws: list[list[int]], text: str) -> None:
    assert raws == [PREFIX_BYTES, TAIL_BYTES] * 4 + [PREFIX_BYTES]
    assert tokens == ["", "の"] * 4 + [""]
    assert "".join(tokens) == text == "のののの"


def test_chat_logprobs_carry_real_bytes(client, token_ids):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "日本"}],
        logprobs=True,
        top_logprobs=2,
        **_alternating(token_ids, CHAT_LEAD),
    )
    content = r.choices[0].logprobs.content
    _check([t.token for t in content], [t.bytes for t in content], r.choices[0].message.content)
    assert REPLACEMENT_BYTES not in [a.bytes for t in content for a in t.top_logprobs]


def test_streamed_chat_logprobs_join_across_chunks(client, token_ids):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "日本"}],
        logprobs=True,
        stream=True,
        **_alternating(token_ids, CHAT_LEAD),
    )
    tokens, raws, text = [], [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for t in choice.logprobs.content if choice.logprobs else []:
            tokens.append(t.token)
            raws.append(t.bytes)
    _check(tokens, raws, text)


def test_completion_tokens_and_offsets_join_to_the_text(client, token_ids):
    r = client.completions.create(
        model="tiny", prompt="日本", logprobs=1, **_alternating(token_ids, COMPLETION_LEAD)
    )
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert lp.tokens == ["", "の"] * 4 + [""] and text == "のののの"
    assert lp.text_offset == [0, 0, 1, 1, 2, 2, 3, 3, 4]
