"""Tool-call formats: parsing whole and streamed outputs, forced-call grammars, template helpers."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.api.tool_calls import (
    FORMAT_NAMES,
    ParsedToolCall,
    call_grammar,
    detect,
    format_for,
    get_format,
    new_call_id,
    template_messages,
    template_supports_tools,
)

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_models import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

QWEN_DIR = Path("/root/.cache/specserve/converted/Qwen2.5-Coder-0.5B-Instruct-bfloat16-34227ed207536d0b")


def call(name: str, **arguments) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

# (format, output, expected content, expected calls)
CASES = [
    ("hermes", "Just text, no call. a < b, <tool x", "Just text, no call. a < b, <tool x", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", "", [call("get_weather", city="Paris")]),
    (
        "hermes",
        f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n',
        "Let me check.",
        [call("get_weather", city="Paris"), call("get_time", zone="CET")],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "say", "arguments": {"text": "日本語 ça va? 🙂"}}\n</tool_call>',
        "",
        [call("say", text="日本語 ça va? 🙂")],
    ),
    (  # arguments double-encoded as a JSON string
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": "{\\"n\\": 3}"}\n</tool_call>',
        "",
        [call("f", n=3)],
    ),
    (  # malformed JSON and a nameless object stay content, verbatim
        "hermes",
        'Hi <tool_call>\n{name: f}\n</tool_call> and <tool_call>{"arguments": {}}</tool_call>',
        'Hi <tool_call>\n{name: f}\n</tool_call> and <tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (  # the tag mentioned in prose is content; the real call after it is a call
        "hermes",
        'Wrap calls in <tool_call> tags. <tool_call>{"name": "g"}</tool_call> done',
        "Wrap calls in <tool_call> tags.done",
        [call("g")],
    ),
    (  # cut off after the JSON, before </tool_call>
        "hermes",
        f"<tool_call>\n{WEATHER}\n",
        "",
        [call("get_weather", city="Paris")],
    ),
    ("hermes", 'Cut off: <tool_call>\n{"name": "f", "argu', 'Cut off: <tool_call>\n{"name": "f", "argu', []),
    ("hermes", "ends with a marker <tool_call>", "ends with a marker <tool_call>", []),
    (  # Qwen2.5-Coder-0.5B answers with the bare object, no <tool_call> wrapper (measured)
        "hermes",
        '\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "",
        [call("get_weather", city="Paris")],
    ),
    ("hermes", '{"city": "Paris"}', '{"city": "Paris"}', []),  # plain JSON data is not a call
    ("hermes", '{"name": "f"} is a call?', '{"name": "f"} is a call?', []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [call("get_weather", city="Paris")],
    ),
    (
        "llama3_json",
        '  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [1, 2]}}\n'
        '{"name": "c", "parameters": {}}',
        "",
        [call("a", x=1), call("b", y=[1, 2]), call("c")],
    ),
    (
        "llama3_json",
        'The answer is {"name": "a", "parameters": {}}',
        'The answer is {"name": "a", "parameters": {}}',
        [],
    ),
    ("llama3_json", '{"name": "a", "parameters": {oops}}', '{"name": "a", "parameters": {oops}}', []),
    ("llama3_json", '{"name": "just data"}', '{"name": "just data"}', []),
    ("llama3_json", '{"name": "a", "parameters": {}} Anything else?', "Anything else?", [call("a")]),
    ("llama3_json", "  <|python", "  <|python", []),
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Sure.",
        [call("get_weather", city="Paris"), call("get_time", zone="CET")],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "say", "arguments": {"text": "naïve"}}]',
        "",
        [call("say", text="naïve")],
    ),
    ("mistral", "[TOOL_CALLS] is how I call tools.", "[TOOL_CALLS] is how I call tools.", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {]',
        '[TOOL_CALLS][{"name": "f", "arguments": {]',
        [],
    ),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}] tail', '[TOOL_CALLS][{"arguments": {}}] tail', []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse(fmt, text, content, calls):
    assert get_format(fmt).parse(text) == (content, calls)


def _streamed(fmt: str, chunks: list[str]) -> tuple[str, list[ParsedToolCall]]:
    """Feeds chunks; checks that content streamed so far is always a prefix of the final content."""
    final_content, _ = get_format(fmt).parse("".join(chunks))
    stream = get_format(fmt).stream()
    content, calls = "", []
    for events in [*(stream.feed(c) for c in chunks), stream.finish()]:
        for event in events:
            if isinstance(event, str):
                assert event, "empty content event"
                content += event
                assert final_content.startswith(content), (content, final_content)
            else:
                calls.append(event)
    return content, calls


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_stream_matches_parse_for_every_chunking(fmt, text, content, calls):
    expected = (content, calls)
    assert _streamed(fmt, list(text)) == expected
    for cut in range(len(text) + 1):
        assert _streamed(fmt, [text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _streamed(fmt, chunks) == expected, chunks


# Pieces of every format's syntax, valid calls and near-misses, for outputs no one wrote by hand.
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "<|py",
    WEATHER,
    '{"name": "f", "parameters": {}}',
    '[{"name": "g", "arguments": {"x": 1}}]',
    '{"name": ',
    '"arguments": ',
    "{",
    "}",
    "[",
    "]",
    ";",
    '"',
    "\n",
    " ",
    "text",
    "é🙂",
    "NaN",
]


@settings(max_examples=300, deadline=None)
@given(
    fmt=st.sampled_from(FORMAT_NAMES),
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=10),
    seed=st.integers(0, 2**16),
)
def test_any_output_parses_and_streams_the_same(fmt, pieces, seed):
    text = "".join(pieces)
    content, calls = get_format(fmt).parse(text)
    if not calls:
        assert content == text  # nothing is lost or rewritten when there is no call
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _streamed(fmt, chunks) == (content, calls)


def test_deep_nesting_and_nan_stay_content():
    deep = '<tool_call>{"name": "f", "arguments": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}</tool_call>"
    assert get_format("hermes").parse(deep) == (deep, [])
    nan = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    assert get_format("hermes").parse(nan) == (nan, [])
    infinite = '[TOOL_CALLS][{"name": "f", "arguments": {"x": -Infinity}}]'
    assert get_format("mistral").parse(infinite) == (infinite, [])


def test_stream_holds_back_a_possible_marker():
    stream = get_format("hermes").stream()
    assert stream.feed("Sure, checking. <tool") == ["Sure, checking."]
    assert stream.feed('_call>\n{"name": "f", ') == []
    assert stream.feed('"arguments": {}}\n</tool_call>') == [call("f")]
    assert stream.feed("\n") == []
    assert stream.feed("<toolbox> is a tag") == ["<toolbox> is a tag"]
    assert stream.finish() == []


def test_llama3_streams_text_at_once_and_holds_json_until_finish():
    text_stream = get_format("llama3_json").stream()
    assert text_stream.feed("  ") == []
    assert text_stream.feed("Hello") == ["  Hello"]
    assert text_stream.feed(" {x}") == [" {x}"]
    json_stream = get_format("llama3_json").stream()
    assert json_stream.feed('{"name": "f", ') == []
    assert json_stream.feed('"parameters": {}}') == []
    assert json_stream.finish() == [call("f")]


def test_arguments_are_compact_json_objects():
    _, [parsed] = get_format("hermes").parse(
        '<tool_call>{"name": "f", "arguments": {"a": [1, 2], "b": {"c": null}, "u": "é"}}</tool_call>'
    )
    assert parsed.arguments == '{"a":[1,2],"b":{"c":null},"u":"é"}'
    assert json.loads(parsed.arguments) == {"a": [1, 2], "b": {"c": None}, "u": "é"}


# ---- formats by name and by chat template -------------------------------------------------------

LLAMA31_SNIPPET = (
    "{%- if tools is not none %}{{- 'Environment: ipython' }}{%- endif %}"
    "{%- if tool_call.name == 'brave_search' %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}"
)
LLAMA32_SNIPPET = (
    '{%- if tools is not none %}{{- \'Respond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.' }}{%- endif %}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
)
MISTRAL_SNIPPET = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}{%- if tools %}[AVAILABLE_TOOLS]{% endif %}"


@pytest.mark.parametrize(
    "template,expected",
    [
        (LLAMA31_SNIPPET, "llama3_json"),
        (LLAMA32_SNIPPET, "llama3_json"),
        (MISTRAL_SNIPPET, "mistral"),
        ("{% if tools %}<tool_call>{% endif %}", "hermes"),
        (CHAT_TEMPLATE, None),
    ],
)
def test_detect_from_snippets(template, expected):
    assert detect(template) == expected
    assert template_supports_tools(template) is (expected is not None)


def _qwen_template() -> str:
    if not (QWEN_DIR / "tokenizer_config.json").exists():
        pytest.skip(f"{QWEN_DIR} is not on this machine")
    return json.loads((QWEN_DIR / "tokenizer_config.json").read_text())["chat_template"]


def test_detect_qwen25_template():
    template = _qwen_template()
    assert detect(template) == "hermes"
    assert template_supports_tools(template)
    assert format_for("auto", template).name == "hermes"


def test_get_format_names_the_choices():
    assert set(FORMAT_NAMES) == {"hermes", "llama3_json", "mistral"}
    assert format_for("mistral", None).name == "mistral"
    assert format_for("auto", CHAT_TEMPLATE) is None
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_format("qwen")


def test_new_call_id():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# ---- messages for chat templates -----------------------------------------------------------------

MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


def test_template_messages_decodes_arguments_without_touching_the_input():
    before = json.dumps(MESSAGES)
    out = template_messages(MESSAGES)
    assert json.dumps(MESSAGES) == before
    assert out[0] is MESSAGES[0] and out[2] is MESSAGES[2]
    assert out[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert template_messages(out) == out  # dict arguments pass through


def test_template_messages_rejects_bad_arguments():
    bad = json.loads(json.dumps(MESSAGES))
    bad[1]["tool_calls"][0]["function"]["arguments"] = '{"city": Paris}'
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]"):
        template_messages(bad)
    bad[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(ValueError, match=r"messages\[1\].*JSON object"):
        template_messages(bad)


def test_qwen_template_renders_converted_messages(tokenizer):
    rendered = tokenizer.apply_chat_template(
        template_messages(MESSAGES), tools=[TOOLS[0]], chat_template=_qwen_template(), tokenize=False
    )
    assert f"<tool_call>\n{WEATHER}\n</tool_call>" in rendered
    _, calls = get_format("hermes").parse(rendered.split("<|im_start|>assistant")[1])
    assert calls == [call("get_weather", city="Paris")]


# ---- forced calls: grammars checked with llguidance on a tiny tokenizer --------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def lltok(tokenizer):
    llguidance_hf = pytest.importorskip("llguidance.hf")
    return llguidance_hf.from_tokenizer(tokenizer)


def _calls_text(fmt: str, calls: list[tuple[str, str]]) -> str:
    """What a model writes for these (name, arguments JSON) calls, exactly as the grammar spells it."""
    f = get_format(fmt)
    bodies = [
        "".join(f.call_open) + f'{{"name": "{name}", "{f.arguments_key}": {args}}}' + "".join(f.call_close)
        for name, args in calls
    ]
    return "".join(f.list_open) + "".join(f.separator).join(bodies) + "".join(f.list_close)


def _accepted(lltok, tokenizer, grammar: str, text: str | list[int]) -> bool:
    """Whether the grammar accepts the whole text and is then complete."""
    from llguidance import LLMatcher

    compiled = LLMatcher.grammar_from_lark(grammar)
    assert LLMatcher.validate_grammar(compiled, lltok) == ""
    matcher = LLMatcher(lltok, compiled, log_level=0)
    ids = tokenizer.encode(text) if isinstance(text, str) else text
    if matcher.validate_tokens(ids) < len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return matcher.is_accepting()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_named_choice_accepts_only_that_function_with_valid_arguments(fmt, lltok, tokenizer):
    grammar = call_grammar(fmt, TOOLS, "get_weather", parallel=False)
    good = [
        '{"city": "Paris"}',
        '{"city":"Paris","days":3}',
        '{"city": "Zürich, 日本", "days": -1}',
    ]
    for args in good:
        text = _calls_text(fmt, [("get_weather", args)])
        assert _accepted(lltok, tokenizer, grammar, text), text
        # What the grammar lets through, the parser turns back into the same call.
        assert get_format(fmt).parse(text) == ("", [call("get_weather", **json.loads(args))])
    bad = [
        ("get_time", "{}"),  # another function
        ("get_weather", '{"city": 3}'),  # wrong type
        ("get_weather", '{"days": 3}'),  # missing required
        ("get_weather", '{"city": "Paris", "days": "3"}'),
        ("get_weather", '{"city":  "Paris"}'),  # runaway whitespace is not admitted
    ]
    for name, args in bad:
        assert not _accepted(lltok, tokenizer, grammar, _calls_text(fmt, [(name, args)])), (name, args)
    assert not _accepted(lltok, tokenizer, grammar, "Sure! " + _calls_text(fmt, [("get_weather", good[0])]))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_required_admits_any_tool_and_parallel_controls_the_count(fmt, lltok, tokenizer):
    one = _calls_text(fmt, [("get_time", '{"anything": [1, {"goes": true}]}')])
    two = _calls_text(fmt, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    single = call_grammar(fmt, TOOLS, "required", parallel=False)
    several = call_grammar(fmt, TOOLS, "required", parallel=True)
    assert _accepted(lltok, tokenizer, single, one)
    assert not _accepted(lltok, tokenizer, single, two)
    assert _accepted(lltok, tokenizer, several, one)
    assert _accepted(lltok, tokenizer, several, two)
    assert not _accepted(lltok, tokenizer, several, _calls_text(fmt, []))
    assert get_format(fmt).parse(two) == ("", [call("get_weather", city="Paris"), call("get_time")])
    assert not _accepted(lltok, tokenizer, several, _calls_text(fmt, [("get_time", "[1]")]))  # not an object


def test_unknown_choice_and_malformed_tools_raise():
    with pytest.raises(ValueError, match="'get_stock'.*not in tools.*'get_weather', 'get_time'"):
        call_grammar("hermes", TOOLS, "get_stock", parallel=True)
    with pytest.raises(ValueError, match="at least one"):
        call_grammar("hermes", [], "required", parallel=True)
    with pytest.raises(ValueError, match="defined twice"):
        call_grammar("hermes", [TOOLS[0], TOOLS[0]], "required", parallel=True)
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        call_grammar("hermes", [{"type": "function", "function": {}}], "required", parallel=True)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        call_grammar("nope", TOOLS, "required", parallel=True)


def test_special_marker_is_matched_as_its_token(lltok, tokenizer):
    # The tiny tokenizer has no <tool_call> token; its <|im_start|> (id 1) stands in for one.
    marker_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    grammar = call_grammar(
        "hermes", TOOLS, "get_time", parallel=False, special_token_ids={"<tool_call>": marker_id}
    )
    text = _calls_text("hermes", [("get_time", "{}")])
    rest = text.removeprefix("<tool_call>")
    assert _accepted(lltok, tokenizer, grammar, [marker_id, *tokenizer.encode(rest)])
    assert not _accepted(lltok, tokenizer, grammar, text)  # the spelling is not the token


def test_call_grammar_leaves_the_tools_untouched():
    tools = json.loads(json.dumps(TOOLS))
    call_grammar("mistral", tools, "required", parallel=True)
    assert tools == TOOLS
