"""`bench latency --response-format`: which constraint each prompt gets, how the prompt asks for it, and
whether an output honours it.

A constrained benchmark must give the model a reason to write JSON: a grammar alone would still force
valid output, but a model that wants to write prose fights the mask at every step and ends in long
strings of filler, which measures the mask rather than structured-output decoding as users run it. So
the last user message also asks for the JSON (and, with a schema, shows it).

Schemas come from prompts/json_schemas.json and are handed out by cycling through their sorted names by
prompt index: the same prompt list always gets the same schemas, whatever the method order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from .prompt_sets import PROMPTS_DIR, Prompt

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
SCHEMAS_FILE = PROMPTS_DIR / "json_schemas.json"


@dataclass(frozen=True)
class Constraint:
    """One prompt's structured-output constraint: `kind` is a StructuredOutput kind."""

    kind: str  # json_object | json_schema
    schema_name: str | None = None
    schema: dict[str, Any] | None = None

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema, separators=(",", ":")) if self.schema is not None else ""

    @property
    def instruction(self) -> str:
        if self.kind == "json_schema":
            return f"Answer only with JSON matching this schema: {self.schema_text}"
        return "Answer only with a JSON object."

    def structured_output(self) -> Any:
        from specserve.engine.sampling_params import StructuredOutput

        return StructuredOutput(self.kind, self.schema_text)


def load_schemas() -> dict[str, dict[str, Any]]:
    return json.loads(SCHEMAS_FILE.read_text(encoding="utf-8"))


def assign(prompts: list[Prompt], response_format: str) -> dict[str, Constraint]:
    """prompt id -> its constraint (empty for text): schema i mod 20 for prompt i, by sorted name."""
    if response_format == "text":
        return {}
    if response_format == "json_object":
        return {p.id: Constraint("json_object") for p in prompts}
    schemas = load_schemas()
    names = sorted(schemas)
    return {
        p.id: Constraint("json_schema", names[i % len(names)], schemas[names[i % len(names)]])
        for i, p in enumerate(prompts)
    }


def with_instruction(prompt: Prompt, constraint: Constraint | None) -> Prompt:
    """The prompt with the constraint's instruction on a new line of its last user message."""
    if constraint is None:
        return prompt
    messages = [dict(m) for m in prompt.messages]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        messages.append({"role": "user", "content": constraint.instruction})
    else:
        messages[last]["content"] = f"{messages[last]['content']}\n\n{constraint.instruction}"
    return replace(prompt, messages=messages)


def check(text: str, constraint: Constraint, finish_reason: str | None) -> dict[str, Any]:
    """Does the output parse as JSON, and validate (an object for json_object, its schema for
    json_schema)? An output cut by the length limit counts as invalid even when it happens to parse."""
    import jsonschema

    hit_length = finish_reason == "length"
    try:
        value = json.loads(text)
        parses = True
    except ValueError:
        value, parses = None, False
    error = None
    if not parses:
        error = "not JSON"
    elif constraint.kind == "json_object" and not isinstance(value, dict):
        error = "not an object"
    elif constraint.kind == "json_schema":
        try:
            jsonschema.validate(value, constraint.schema or {})
        except jsonschema.ValidationError as exc:
            error = f"schema: {exc.message[:120]}"
    if hit_length:
        error = "hit the length limit" + (f" ({error})" if error else "")
    return {"json_parses": parses, "json_valid": error is None, "json_error": error, "hit_length": hit_length}
