"""Structured output and tool calling through a real server on 127.0.0.1, with the official openai
client and langchain-openai: response_format, forced tool calls (streamed and not), a tool-message
turn, speculation on and off giving the same greedy output, and the 400s for bad input."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import start_server
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

SCHEMAS = json.loads((Path(__file__).parents[2] / "benchmarks/prompts/json_schemas.json").read_text())

# A Hermes-style template (Qwen2.5's conventions, shortened): tools in the system turn, calls written
# as <tool_call>{json}</tool_call>, tool results as <tool_response> user turns.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    '</tools>\nCall one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tools")
    build_tiny_model(path, "llama", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tool_server(tool_model_dir, tmp_path_factory):
    srv = start_server(tool_model_dir, tmp_path_factory.mktemp("logs"), "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.api_url, api_key="unused", max_retries=0)


def _chat(client, **kwargs):
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model="tiny", **kwargs)


@pytest.mark.parametrize("name", ["person", "nested_address", "top_level_array", "defs_ref", "event"])
def test_json_schema_response_validates(client, name):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    out = _chat(client, response_format=fmt)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[name])


def test_json_object_and_completions_response_format(client):
    out = _chat(client, response_format={"type": "json_object"}, max_tokens=200)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert out.choices[0].message.content.startswith("{")
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS["color_enum"]}}
    comp = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=30, temperature=0, extra_body={"response_format": fmt}
    )
    assert json.loads(comp.choices[0].text)["color"] in ("red", "green", "blue")


def test_greedy_structured_output_same_with_and_without_speculation(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["event"]}}
    on = _chat(client, response_format=fmt)
    off = _chat(client, response_format=fmt, extra_body={"speculative": {"enabled": False}})
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.usage.speculative["num_forced_tokens"] > 0  # type: ignore[index]
    assert off.usage.speculative["num_draft_tokens"] == 0  # type: ignore[index]


def test_openai_parse_with_pydantic(client):
    class Weather(BaseModel):
        city: str = Field(max_length=10)
        celsius: int = Field(ge=-50, le=50)

    out = client.beta.chat.completions.parse(
        model="tiny", messages=USER, response_format=Weather, temperature=0, max_tokens=60
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Weather) and -50 <= parsed.celsius <= 50


def test_named_tool_choice_forces_a_valid_call(client):
    out = _chat(
        client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_single_and_streamed(client):
    kwargs = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    whole = _chat(client, **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert len(whole.choices[0].message.tool_calls) == 1
    call = whole.choices[0].message.tool_calls[0]
    streamed_calls, finish = [], None
    for chunk in _chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            streamed_calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert streamed_calls[0].index == 0 and streamed_calls[0].id.startswith("call_")


def test_tool_message_turn_round_trip(client):
    first = _chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = _chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    # /tokenize renders the same conversation the same way (tool-call arguments as objects).
    request = urllib.request.Request(
        str(client.base_url).rstrip("/").removesuffix("/v1") + "/tokenize",
        data=json.dumps({"messages": messages, "tools": [WEATHER]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["count"] == second.usage.prompt_tokens


def test_langchain_structured_output_and_tools(tool_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=10)
        unit: str = Field(pattern="^(c|f)$")

    llm = ChatOpenAI(
        base_url=tool_server.api_url,
        api_key="unused",
        model="tiny",
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    for method in ("json_schema", "function_calling"):
        # strict: no extra properties, so even a random model's call ends within max_tokens.
        result = llm.with_structured_output(Weather, method=method, strict=True).invoke("Weather in Paris?")
        assert isinstance(result, Weather)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage("Weather in Paris?")
    ai = bound.invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    answer = llm.bind_tools([WEATHER]).invoke(
        [question, ai, ToolMessage('{"temperature": 21}', tool_call_id=ai.tool_calls[0]["id"])]
    )
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    },
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_structured_requests_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, **kwargs)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_tools_on_a_template_without_tool_support_are_400(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=4)
    assert err.value.body["param"] == "tools"  # type: ignore[index]
    assert "no tool support" in err.value.body["message"]  # type: ignore[index]
    # tool_choice none: the tools are only passed to the template, which may ignore them.
    ok = client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert ok.choices[0].message.tool_calls is None
