"""No request field is dropped silently: each top-level field of a request body is implemented, refused
with a 400 naming it, or accepted and logged as ignored.

The request models ignore unknown keys (clients send every field of the OpenAI spec, and vLLM's), so a
field we do not implement would otherwise look honoured. Three kinds:

- implemented: the request model's own fields (so this cannot drift from protocol.py), less IGNORED;
- refused: fields whose effect we cannot give (`best_of` > 1, `echo`, image parts, ...): a 400 with
  `param` naming the field, since an answer without that effect would be wrong rather than degraded;
- ignored: fields with no effect on the answer here (`store`, `user`, ...) and any name we do not
  know: accepted, one WARNING per field name per server (as vLLM does), so an operator can see them.

A null value counts as absent: in the OpenAI API null means "not set", so nothing is being ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .errors import ApiError
from .protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("specserve.api")

# Accepted, no effect here: nothing is stored, there is one service tier, no reasoning or search step,
# `user` / `safety_identifier` / `prompt_cache_key` are hints to OpenAI's own abuse and cache systems.
IGNORED = frozenset(
    {
        "store",
        "metadata",
        "service_tier",
        "user",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "prompt_cache_key",
        "safety_identifier",
    }
)

# Implemented by the structured-output work of issue 16 (llguidance); listed as well as derived from the
# models so that whether they warn does not depend on which of the two changes lands first.
_STRUCTURED_CHAT = frozenset({"response_format", "tools", "tool_choice", "parallel_tool_calls"})
_STRUCTURED_COMPLETION = frozenset({"response_format"})

# Content-part types that carry media (OpenAI's, and vLLM's audio_url / video_url): the models read text.
MEDIA_PARTS = ("image_url", "input_audio", "file", "audio_url", "video_url")

MAX_WARNED_NAMES = 1024  # clients choose field names: the set of names already logged stays bounded

Check = Callable[[Any], str | None]  # a field's value -> why it is refused, or None when it is honoured


def _only_text(value: Any) -> str | None:
    if isinstance(value, list) and all(m == "text" for m in value):
        return None
    return 'only text output is supported (modalities: ["text"])'


def _refused(message: str) -> Check:
    return lambda _value: message


def _best_of(value: Any) -> str | None:
    if type(value) is int and value == 1:
        return None
    return "best_of > 1 is not supported; ask for several choices with n"


def _echo(value: Any) -> str | None:
    return None if value is False else "echo is not supported"


def _suffix(value: Any) -> str | None:
    return None if value == "" else "suffix (insertion) is not supported"


_LEGACY_FUNCTIONS = "the legacy function-calling API is not supported; use tools and tool_choice"

CHAT_CHECKS: Mapping[str, Check] = {
    "functions": _refused(_LEGACY_FUNCTIONS),
    "function_call": _refused(_LEGACY_FUNCTIONS),
    "modalities": _only_text,
    "audio": _refused("audio output is not supported"),
    "prediction": _refused("predicted outputs (prediction) are not supported"),
}
COMPLETION_CHECKS: Mapping[str, Check] = {"best_of": _best_of, "echo": _echo, "suffix": _suffix}


def check_content_parts(messages: Any) -> None:
    """A media content part is refused with its position; the models would otherwise answer blind."""
    if not isinstance(messages, list):
        return  # not a list: the request model's validation reports it
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                param = f"messages[{i}].content[{j}]"
                raise ApiError(400, f"{param}: content parts of type {kind} are not supported", param)


@dataclass(frozen=True)
class EndpointFields:
    """What one endpoint does with each top-level field of its body."""

    implemented: frozenset[str]
    checks: Mapping[str, Check] = field(default_factory=dict)  # recognised; refused unless the check passes
    has_messages: bool = False

    @classmethod
    def of(
        cls,
        *models: type[BaseModel],
        extra: Iterable[str] = (),
        checks: Mapping[str, Check] | None = None,
        has_messages: bool = False,
    ) -> EndpointFields:
        names = {name for model in models for name in model.model_fields} | set(extra)
        return cls(frozenset(names - IGNORED), checks or {}, has_messages)

    def check(self, data: dict[str, Any]) -> list[str]:
        """Raise the 400 for a refused field; return the names this request sends that have no effect."""
        for name, check in self.checks.items():
            if data.get(name) is not None and (why := check(data[name])) is not None:
                raise ApiError(400, f"{name}: {why}", name)
        if self.has_messages:
            check_content_parts(data.get("messages"))
        return sorted(
            name
            for name, value in data.items()
            if value is not None and name not in self.implemented and name not in self.checks
        )


CHAT_FIELDS = EndpointFields.of(
    ChatCompletionRequest, extra=_STRUCTURED_CHAT, checks=CHAT_CHECKS, has_messages=True
)
COMPLETION_FIELDS = EndpointFields.of(
    CompletionRequest, extra=_STRUCTURED_COMPLETION, checks=COMPLETION_CHECKS
)


class IgnoredFieldLog:
    """The field names this server has already warned about (one per app, kept in the app's state)."""

    def __init__(self, limit: int = MAX_WARNED_NAMES):
        self.limit = limit
        self.warned: set[str] = set()
        self._full = False

    def warn(self, endpoint: str, names: Iterable[str]) -> None:
        new = [n for n in names if n not in self.warned]
        if not new or self._full:
            return
        new = new[: self.limit - len(self.warned)]
        self.warned.update(new)
        # json.dumps escapes control characters: a client's field name cannot forge a log line.
        shown = ", ".join(json.dumps(n[:64]) for n in new)
        logger.warning(
            "%s: the following fields were present in the request but ignored: {%s} (logged once per field)",
            endpoint,
            shown,
        )
        if len(self.warned) >= self.limit:
            self._full = True
            logger.warning("%d ignored field names logged; further new names are not logged", self.limit)
