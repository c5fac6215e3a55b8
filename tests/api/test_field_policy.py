"""No silently ignored request fields: refused ones are 400s naming the field, ignored ones are logged once
per field name per server, implemented ones are quiet. The policy's sets, then a real server."""

from __future__ import annotations

import logging
import uuid

import openai
import pytest

from specserve.api.field_policy import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED, IgnoredFieldLog

CHAT_IMPLEMENTED = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "ignore_eos", "stream", "stream_options", "speculative", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip
COMPLETION_IMPLEMENTED = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "ignore_eos", "stream", "stream_options", "speculative", "logprobs", "echo", "suffix", "best_of",
    "response_format",
}  # fmt: skip
USER = [{"role": "user", "content": "hello"}]


# --- the policy itself ----------------------------------------------------------------------------
def test_implemented_sets_are_the_documented_ones():
    """Derived from the request models: a field added to protocol.py shows up here (and in the README)."""
    assert CHAT_FIELDS.implemented == CHAT_IMPLEMENTED
    # echo, suffix and best_of are honoured only at their defaults (false, "", 1): checked, not ignored
    assert COMPLETION_FIELDS.implemented | set(COMPLETION_FIELDS.checks) == COMPLETION_IMPLEMENTED
    assert not IGNORED & (CHAT_IMPLEMENTED | COMPLETION_IMPLEMENTED)


def test_null_counts_as_absent_and_unknown_names_are_reported_sorted():
    assert CHAT_FIELDS.check({"messages": USER, "functions": None, "store": None, "audio": None}) == []
    assert CHAT_FIELDS.check({"messages": USER, "zeta": 1, "store": False, "max_tokens": 3}) == [
        "store",
        "zeta",
    ]
    assert COMPLETION_FIELDS.check({"prompt": "x", "best_of": 1, "echo": False, "suffix": ""}) == []


def test_warn_once_per_name_and_bounded(caplog):
    log = IgnoredFieldLog(limit=3)
    with caplog.at_level(logging.WARNING, logger="specserve.api"):
        log.warn("/v1/completions", ["a", "b"])
        log.warn("/v1/completions", ["a", "b"])
        log.warn("/v1/chat/completions", ["b", "c\nINFO forged"])
        log.warn("/v1/completions", ["d", "e"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # {a, b}, then {c...} (which fills the set), then "no more are logged"
    assert '"a", "b"' in lines[0] and '"c\\nINFO forged"' in lines[1] and "\n" not in lines[1]
    assert "not logged" in lines[2]
    assert log.warned == {"a", "b", "c\nINFO forged"}


# --- a real server --------------------------------------------------------------------------------
@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=60)


def _chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_body=extra)


def _completion(client, **extra):
    return client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body=extra)


def _part(kind: str) -> dict:
    payloads = {
        "image_url": {"image_url": {"url": "data:image/png;base64,AAAA"}},
        "input_audio": {"input_audio": {"data": "AAAA", "format": "wav"}},
        "file": {"file": {"file_id": "file-1"}},
    }
    return {"type": kind, **payloads[kind]}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
    ],
)
def test_chat_refuses_unimplemented_fields(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, **{field: value})
    assert err.value.param == field
    assert field in err.value.message
    if field.startswith("function"):
        assert "use tools" in err.value.message


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_chat_refuses_media_content_parts(client, kind):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, _part(kind)]},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert err.value.param == "messages[1].content[1]"
    assert f"messages[1].content[1]: content parts of type {kind} are not supported" in err.value.message


@pytest.mark.parametrize(("field", "value"), [("best_of", 2), ("echo", True), ("suffix", "}")])
def test_completions_refuse_unimplemented_fields(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        _completion(client, **{field: value})
    assert err.value.param == field


def _ignored_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line and "but ignored" in line]


def _warnings_naming(log: str, name: str) -> list[str]:
    return [line for line in _ignored_lines(log) if f'"{name}"' in line]


def test_ignored_and_unknown_fields_are_accepted_and_logged_once(server, client):
    unknown = f"x_unknown_{uuid.uuid4().hex[:8]}"
    ignored = {
        "store": True,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "user": "u-1",
        "reasoning_effort": "low",
        "web_search_options": {},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    for _ in range(2):
        assert _chat(client, **ignored, **{unknown: 1}).choices[0].finish_reason
        assert _completion(client, user="u-1", **{unknown + "_c": [1]}).choices[0].finish_reason
    log = server.log()
    for name in [*ignored, unknown, unknown + "_c"]:
        lines = _warnings_naming(log, name)
        assert len(lines) == 1, (name, lines)
        assert "present in the request but ignored" in lines[0]
    assert "/v1/completions" in _warnings_naming(log, unknown + "_c")[0]


def test_honoured_values_of_refusable_fields_and_implemented_fields_do_not_warn(server, client):
    before = len(_ignored_lines(server.log()))
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_completion_tokens=3,
        temperature=0.5,
        top_p=0.9,
        seed=1,
        stop=["zz"],
        n=2,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logit_bias={"5": 1.0},
        stream=False,
        logprobs=True,
        top_logprobs=2,
        modalities=["text"],
        response_format={"type": "text"},
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "stop_token_ids": [3],
            "repetition_penalty": 1.1,
            "ignore_eos": False,
            "speculative": {"enabled": True},
        },
    )
    assert len(r.choices) == 2
    stream = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    assert [c for c in stream][-1].usage.completion_tokens >= 1
    c = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=2,
        best_of=1,
        echo=False,
        suffix="",
        logprobs=1,
        extra_body={"top_k": 3, "speculative": {"num_speculative_tokens": 2}},
    )
    assert c.choices[0].finish_reason
    assert _ignored_lines(server.log())[before:] == []
