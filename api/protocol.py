"""OpenAI request bodies (pydantic). Unknown fields are ignored, as vLLM does; bad values are 400s."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.engine.sampling_params import (
    MAX_NUM_SPECULATIVE_TOKENS,
    InvalidParameterError,
    SamplingParams,
    StructuredOutput,
)

TokenIds = list[Annotated[int, Field(ge=0)]]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class SpeculativeOptions(_Base):
    enabled: bool = True
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_NUM_SPECULATIVE_TOKENS)
    policy: Literal["adaptive", "static"] | None = None  # None: the server's --speculative-policy


class StreamOptions(_Base):
    include_usage: bool = False
    # vLLM's extension: usage so far (prompt, completion, total tokens) on every chunk, so a client can
    # count the tokens a chunk carried (with speculation one chunk may carry several).
    continuous_usage_stats: bool = False


class TextPart(_Base):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Base):
    name: str = Field(..., max_length=256)
    arguments: str = ""  # a JSON object, serialised (as OpenAI sends it)


class ToolCall(_Base):
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates read it (tool-call arguments still JSON text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    # `schema` would shadow BaseModel.schema(): stored as json_schema, spelled "schema" on the wire.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The constraint this format asks for (strict or not, the schema is enforced, as vLLM does)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object", "", "response_format")
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise InvalidParameterError(
                "response_format", "response_format of type json_schema needs json_schema.schema"
            )
        return StructuredOutput("json_schema", json.dumps(self.json_schema.json_schema), "response_format")


class FunctionDefinition(_Base):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any JSON object
    strict: bool | None = None


class ToolDefinition(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Base):
    name: str = Field(..., max_length=64)


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: FunctionName


class SamplingFields(_Base):
    model: str | None = Field(None, max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    ignore_eos: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    response_format: ResponseFormat | None = None

    def _check_stream_options(self) -> None:
        # OpenAI and vLLM refuse stream_options without stream; usage on every chunk without usage at
        # all is a contradiction, not something to guess at.
        options = self.stream_options
        if options is None:
            return
        if not self.stream:
            raise InvalidParameterError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        if options.continuous_usage_stats and not options.include_usage:
            raise InvalidParameterError(
                "stream_options", "stream_options.continuous_usage_stats needs stream_options.include_usage"
            )

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, structured: StructuredOutput | None = None
    ) -> SamplingParams:
        self._check_stream_options()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise InvalidParameterError("logit_bias", "logit_bias keys must be token ids") from None
        spec = self.speculative or SpeculativeOptions()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=bias,
            logprobs=logprobs,
            n=self.n,
            speculative_enabled=spec.enabled,
            num_speculative_tokens=spec.num_speculative_tokens,
            speculative_policy=spec.policy,
            structured_output=structured
            or (self.response_format.structured_output() if self.response_format else None),
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
