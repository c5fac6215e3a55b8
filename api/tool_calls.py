"""Tool calling: each model family's call syntax, parsed from output text and forced by grammar.

A format (one per chat-template family) knows how its models write calls:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>      (Qwen2.5, Hermes)
    llama3_json  <|python_tag|>{"name": "f", "parameters": {...}}; {...}         (Llama 3.1 / 3.2)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]

`parse()` splits a finished output into content and calls; `stream()` does the same incrementally
for text deltas (parse() is the stream fed once, so the two can never disagree). `call_grammar()`
writes an llguidance Lark grammar that admits only well-formed calls, for `tool_choice` "required"
or a named function; each function's JSON-schema `parameters` constrain its arguments via `%json`.

Whitespace next to a call (the newlines between `</tool_call>` and the next `<tool_call>`) is not
content. Text that looks like a call but does not decode (bad JSON, no name) stays content verbatim.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, serialised compactly


# A streaming event: content text to send now, or a completed call.
ToolCallEvent = str | ParsedToolCall

# Reads the text after a call marker: (body, how much of it the last read saw, final). None: need more
# text. Otherwise (characters used, the calls, or None when the text is not a call: then the marker
# and those characters are content). `seen` lets a reader look at new text only, so streaming a long
# call token by token stays linear.
_BodyReader = Callable[[str, int, bool], tuple[int, list[ParsedToolCall] | None] | None]
_NON_SPACE = re.compile(r"\S")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json accepts NaN and Infinity, which would come back out as arguments no client can read.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
# What decoding model output may raise: bad JSON, or nesting deeper than the C decoder's recursion.
_DECODE_ERRORS = (ValueError, RecursionError)
_ARGUMENT_KEYS = ("arguments", "parameters")
# At most one space between JSON tokens in forced arguments: both `{"a":1}` and `{"a": 1}` styles
# pass, but a model cannot loop on whitespace (unbounded newlines) until max_tokens. lenient: schema
# keywords llguidance does not implement are ignored instead of failing the request, as non-strict
# OpenAI tools may carry any schema.
_JSON_OPTIONS = {"whitespace_pattern": " ?", "lenient": True}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from_object(obj: Any, require_arguments: bool = False) -> ParsedToolCall | None:
    """A decoded {"name", "arguments"|"parameters"} object as a call, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in obj), None)
    if key is None and require_arguments:
        return None
    arguments = obj.get(key) if key else None
    if isinstance(arguments, str):  # some models double-encode: "arguments": "{\"city\": ...}"
        try:
            arguments = _DECODER.decode(arguments)
        except _DECODE_ERRORS:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _merge(events: list[ToolCallEvent]) -> list[ToolCallEvent]:
    """Joins adjacent content strings and drops empty ones."""
    out: list[ToolCallEvent] = []
    for event in events:
        if isinstance(event, str):
            if not event:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += event
                continue
        out.append(event)
    return out


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream(Protocol):
    def feed(self, delta: str) -> list[ToolCallEvent]: ...

    def finish(self) -> list[ToolCallEvent]: ...


class _MarkedCallStream:
    """Content with calls that each start at a marker (`<tool_call>`, `[TOOL_CALLS]`).

    Content is emitted as soon as it cannot be the start of a marker; trailing whitespace is held too,
    because whitespace just before a call is not content.
    """

    def __init__(self, marker: str, read_body: _BodyReader) -> None:
        self._marker = marker
        self._read_body = read_body
        self._text = ""  # held content: trailing whitespace and a possible partial marker
        self._body: str | None = None  # text after a marker while inside a call
        self._seen = 0  # how much of the body the reader has seen
        self._gap = ""  # whitespace before the current marker: content only if the call is malformed
        self._after_call = False  # whitespace right after a call is dropped

    def feed(self, delta: str) -> list[ToolCallEvent]:
        return self._pump(delta, final=False)

    def finish(self) -> list[ToolCallEvent]:
        return self._pump("", final=True)

    def _pump(self, delta: str, final: bool) -> list[ToolCallEvent]:
        out: list[ToolCallEvent] = []
        if self._body is None:
            self._text += delta
        else:
            self._body += delta
        while True:
            if self._body is not None:
                read = self._read_body(self._body, self._seen, final)
                if read is None:
                    self._seen = len(self._body)
                    break
                used, calls = read
                if calls is None:
                    out.append(self._gap + self._marker + self._body[:used])
                else:
                    out.extend(calls)
                    self._after_call = True
                self._text, self._body, self._gap = self._body[used:], None, ""
                continue
            if self._after_call:
                self._text = self._text.lstrip()
                if not self._text:
                    break
                self._after_call = False
            start = self._text.find(self._marker)
            if start >= 0:
                before = self._text[:start]
                head = before.rstrip()
                out.append(head)
                self._gap = before[len(head) :]
                self._body = self._text[start + len(self._marker) :]
                self._text, self._seen = "", 0
                continue
            if final:
                out.append(self._text)
                self._text = ""
                break
            held = _partial_marker_len(self._text, self._marker)
            head = self._text[: len(self._text) - held].rstrip()
            out.append(head)
            self._text = self._text[len(head) :]
            break
        return _merge(out)


class _JsonOnlyStream:
    """Llama 3: the whole output is calls when it starts with `{` (after `<|python_tag|>`).

    There is no marker to wait for, so a JSON start holds everything until finish(); any other start
    streams as plain content at once.
    """

    def __init__(self, prefix: str, parse_calls: Callable[[str], tuple[str, list[ParsedToolCall]]]) -> None:
        self._prefix = prefix
        self._parse_calls = parse_calls
        self._held = ""
        self._calls_possible: bool | None = None  # None until the first non-whitespace text

    def feed(self, delta: str) -> list[ToolCallEvent]:
        if self._calls_possible is False:
            return _merge([delta])
        self._held += delta
        if self._calls_possible:
            return []
        lead = self._held.lstrip()
        if lead.startswith(("{", self._prefix)):
            self._calls_possible = True
            return []
        if not lead or self._prefix.startswith(lead):
            return []
        self._calls_possible = False
        text, self._held = self._held, ""
        return _merge([text])

    def finish(self) -> list[ToolCallEvent]:
        text, self._held = self._held, ""
        if not self._calls_possible:
            return _merge([text])
        content, calls = self._parse_calls(text)
        return _merge([*calls, content])


class ToolCallFormat(ABC):
    """One model family's tool-call syntax. Stateless; `stream()` makes the per-request parser."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # text that a tokenizer may have as special tokens
    # What call_grammar() makes the model write, as sequences of literal parts (markers kept whole so
    # they can be rendered as special tokens): list_open call (separator call)* list_close, where a
    # call is call_open {"name": NAME, "<arguments_key>": ARGS} call_close.
    arguments_key: ClassVar[str] = "arguments"
    list_open: ClassVar[tuple[str, ...]] = ()
    list_close: ClassVar[tuple[str, ...]] = ()
    call_open: ClassVar[tuple[str, ...]] = ()
    call_close: ClassVar[tuple[str, ...]] = ()
    separator: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def matches_template(self, chat_template: str) -> bool:
        """Whether a chat template writes calls in this format."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new incremental parser for one output."""

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) of a finished output. Never raises."""
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        return content, [e for e in events if isinstance(e, ParsedToolCall)]


class HermesFormat(ToolCallFormat):
    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    call_open = ("<tool_call>", "\n")
    call_close = ("\n", "</tool_call>")
    separator = ("\n",)

    def matches_template(self, chat_template: str) -> bool:
        return "<tool_call>" in chat_template

    def stream(self) -> ToolCallStream:
        return _FirstCharStream(
            lambda: _JsonOnlyStream("<tool_call>", _parse_llama3),
            lambda: _MarkedCallStream("<tool_call>", _read_hermes_body),
        )


class _FirstCharStream:
    """Hermes-family models write `<tool_call>{...}</tool_call>`, but small ones (Qwen2.5-Coder-0.5B,
    measured) often answer a tool question with the bare JSON object alone. An output whose first
    non-whitespace character is `{` is read as bare calls (like Llama 3's: `name` plus `arguments`
    required, else it stays content); any other output goes to the marker parser."""

    def __init__(self, bare: Callable[[], ToolCallStream], marked: Callable[[], ToolCallStream]) -> None:
        self._make_bare, self._make_marked = bare, marked
        self._inner: ToolCallStream | None = None
        self._held = ""

    def feed(self, delta: str) -> list[ToolCallEvent]:
        if self._inner is not None:
            return self._inner.feed(delta)
        self._held += delta
        lead = self._held.lstrip()
        if not lead:
            return []
        self._inner = self._make_bare() if lead.startswith("{") else self._make_marked()
        text, self._held = self._held, ""
        return self._inner.feed(text)

    def finish(self) -> list[ToolCallEvent]:
        if self._inner is None:
            self._inner = self._make_marked()
            text, self._held = self._held, ""
            return self._inner.feed(text) + self._inner.finish()
        return self._inner.finish()


def _read_hermes_body(body: str, seen: int, final: bool) -> tuple[int, list[ParsedToolCall] | None] | None:
    first = _NON_SPACE.search(body)
    if first and first.group() != "{":
        return 0, None  # `<tool_call>` in prose: give it back as content now, not at the end
    end = body.find("</tool_call>", max(0, seen - len("</tool_call>") + 1))
    if end < 0:
        # An unclosed call at the end of the output (cut by max_tokens or a stop) still counts if whole.
        return (len(body), _decode_one(body)) if final else None
    return end + len("</tool_call>"), _decode_one(body[:end])


def _decode_one(text: str) -> list[ParsedToolCall] | None:
    try:
        call = _call_from_object(_DECODER.decode(text))
    except _DECODE_ERRORS:
        return None
    return [call] if call else None


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    separator = ("; ",)

    def matches_template(self, chat_template: str) -> bool:
        return "<|python_tag|>" in chat_template or (
            '"parameters"' in chat_template and "ipython" in chat_template
        )

    def stream(self) -> ToolCallStream:
        return _JsonOnlyStream("<|python_tag|>", _parse_llama3)


def _parse_llama3(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Leading JSON calls separated by `;` or whitespace; what follows them is content."""
    s = text.lstrip().removeprefix("<|python_tag|>")
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        while pos < len(s) and (s[pos].isspace() or (calls and s[pos] == ";")):
            pos += 1
        if pos == len(s) or s[pos] != "{":
            break
        try:
            obj, end = _DECODER.raw_decode(s, pos)
        except _DECODE_ERRORS:
            break
        # No marker vouches for this JSON, so an object without parameters is not taken for a call.
        call = _call_from_object(obj, require_arguments=True)
        if call is None:
            break
        calls.append(call)
        pos = end
    if not calls:
        return text, []
    return s[pos:], calls


class MistralFormat(ToolCallFormat):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    list_open = ("[TOOL_CALLS]", "[")
    list_close = ("]",)
    separator = (", ",)

    def matches_template(self, chat_template: str) -> bool:
        return "[TOOL_CALLS]" in chat_template

    def stream(self) -> ToolCallStream:
        return _MarkedCallStream("[TOOL_CALLS]", _read_mistral_body)


def _read_mistral_body(body: str, seen: int, final: bool) -> tuple[int, list[ParsedToolCall] | None] | None:
    first = _NON_SPACE.search(body)
    if not first:
        return (len(body), None) if final else None
    if first.group() not in "[{":
        return 0, None
    # A JSON array or object cannot be extended, so the first prefix that decodes is the value; it
    # can only start to decode once a closing bracket arrives.
    if not final and "]" not in body[seen:] and "}" not in body[seen:]:
        return None
    try:
        value, end = _DECODER.raw_decode(body, first.start())
    except _DECODE_ERRORS:
        return (len(body), None) if final else None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_object(item) for item in items]
    valid = [c for c in calls if c is not None]
    return end, valid if items and len(valid) == len(items) else None


_FORMATS: Mapping[str, ToolCallFormat] = MappingProxyType(
    {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}
)
FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)


def get_format(name: str) -> ToolCallFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of: {', '.join(FORMAT_NAMES)}"
        ) from None


def detect(chat_template: str) -> str | None:
    """The format whose markers a chat template writes, or None."""
    return next((f.name for f in _FORMATS.values() if f.matches_template(chat_template)), None)


def format_for(flag: str, chat_template: str | None) -> ToolCallFormat | None:
    """The format for a `--tool-call-parser NAME|auto` value; "auto" detects it from the template."""
    if flag == "auto":
        name = detect(chat_template or "")
        return _FORMATS[name] if name else None
    return get_format(flag)


_JINJA_BLOCK = re.compile(r"\{[{%](.*?)[%}]\}", re.DOTALL)


def template_supports_tools(chat_template: str) -> bool:
    """Whether the template reads the `tools` variable (in a Jinja statement or expression)."""
    return any(re.search(r"\btools\b", block) for block in _JINJA_BLOCK.findall(chat_template))


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as HF chat templates expect them: tool-call arguments as dicts, not JSON text.

    Returns a new list; messages with tool calls are copied, the input is left as it was.
    """
    out = []
    for i, message in enumerate(messages):
        tool_calls = message.get("tool_calls")
        if not tool_calls:
            out.append(message)
            continue
        converted = []
        for j, call in enumerate(tool_calls):
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = _DECODER.decode(arguments) if arguments.strip() else {}
                except _DECODE_ERRORS as e:
                    raise ValueError(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}"
                    ) from None
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, dict):
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
            function["arguments"] = arguments
            converted.append({**call, "function": function})
        out.append({**message, "tool_calls": converted})
    return out


def _tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Function name -> parameters schema, for the OpenAI `tools` list."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"tools[{i}].function is missing")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name is missing")
        if name in schemas:
            raise ValueError(f"tools[{i}]: function {name!r} is defined twice")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        schemas[name] = parameters
    return schemas


def call_grammar(
    fmt: str | ToolCallFormat,
    tools: Sequence[Mapping[str, Any]],
    choice: str,
    parallel: bool,
    special_token_ids: Mapping[str, int] | None = None,
) -> str:
    """An llguidance Lark grammar admitting exactly well-formed calls in the format `fmt`.

    choice: "required" (any of the tools) or a function name (only that one). parallel: one or more
    calls, else exactly one. Arguments follow each function's `parameters` schema (a missing one means
    any object); object properties come in the schema's order. special_token_ids maps those of
    `fmt.markers` that the tokenizer has as special tokens to their ids, so the grammar asks for the
    token itself rather than its spelling (which a special token's text never matches).
    Raises ValueError for a choice naming no tool, or malformed tools.
    """
    fmt = fmt if isinstance(fmt, ToolCallFormat) else get_format(fmt)
    schemas = _tool_schemas(tools)
    if choice == "required":
        if not schemas:
            raise ValueError('tool_choice "required" needs at least one function in tools')
        chosen = list(schemas)
    elif choice in schemas:
        chosen = [choice]
    else:
        known = ", ".join(repr(n) for n in schemas) or "none"
        raise ValueError(f"tool_choice names function {choice!r}, which is not in tools (have: {known})")

    def seq(*parts: str) -> str:
        """Literal parts as Lark items; adjacent text is one string literal, special markers tokens."""
        items: list[str] = []
        text = ""
        for part in parts:
            if special_token_ids and part in special_token_ids:
                if text:
                    items.append(json.dumps(text, ensure_ascii=False))
                items.append(f"<[{int(special_token_ids[part])}]>")
                text = ""
            else:
                text += part
        if text:
            items.append(json.dumps(text, ensure_ascii=False))
        return " ".join(items)

    lines = []
    more = f" ({seq(*fmt.separator)} call)*" if parallel else ""
    lines.append(" ".join(filter(None, ["start:", seq(*fmt.list_open), f"call{more}", seq(*fmt.list_close)])))
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    for i, name in enumerate(chosen):
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{fmt.arguments_key}": '
        lines.append(f"call_{i}: {seq(*fmt.call_open, head)} args_{i} {seq('}', *fmt.call_close)}")
        # Arguments are always an object; the schema may leave `type` out.
        schema = {"type": "object", **schemas[name], "x-guidance": _JSON_OPTIONS}
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"
