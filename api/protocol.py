"""OpenAI request bodies (pydantic). Unknown fields are ignored, as vLLM does; bad values are 400s."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.engine.sampling_params import MAX_NUM_SPECULATIVE_TOKENS, SamplingParams

TokenIds = list[Annotated[int, Field(ge=0)]]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class SpeculativeOptions(_Base):
    enabled: bool = True
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_NUM_SPECULATIVE_TOKENS)
    policy: Literal["adaptive", "static"] | None = None  # None: the server's --speculative-policy


class StreamOptions(_Base):
    include_usage: bool = False


class TextPart(_Base):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            from specserve.engine.sampling_params import InvalidParameterError

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
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
