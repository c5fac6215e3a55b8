"""POST /tokenize and /detokenize with vLLM's request and response shapes.

Chat messages are rendered with the model's chat template and then encoded, as vLLM does, so with the
defaults (generation prompt on, no extra special tokens) `count` is the prompt length the chat endpoint
would charge for the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specserve.engine.tokenizer import Tokenizer

from .errors import ApiError
from .field_policy import EndpointFields
from .protocol import ChatMessage
from .tool_calls import template_messages


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TokenizeCompletionRequest(_Base):
    model: str | None = Field(None, max_length=512)
    prompt: str
    add_special_tokens: bool = True  # e.g. a BOS token, for tokenizers that add one
    return_token_strs: bool = False


class TokenizeChatRequest(_Base):
    model: str | None = Field(None, max_length=512)
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open for continuation
    add_special_tokens: bool = False  # the template writes the special tokens itself
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None  # handed to the template as is


class DetokenizeRequest(_Base):
    model: str | None = Field(None, max_length=512)
    tokens: list[int]


PROMPT_FIELDS = EndpointFields.of(TokenizeCompletionRequest)
MESSAGES_FIELDS = EndpointFields.of(TokenizeChatRequest, has_messages=True)
DETOKENIZE_FIELDS = EndpointFields.of(DetokenizeRequest)


def check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def tokenize_variant(data: dict[str, Any]) -> tuple[type[BaseModel], EndpointFields]:
    """The request model for a /tokenize body: a prompt or chat messages, exactly one of them."""
    has_prompt, has_messages = data.get("prompt") is not None, data.get("messages") is not None
    if has_prompt and has_messages:
        raise ApiError(400, "give either prompt or messages, not both", "messages")
    if not has_prompt and not has_messages:
        raise ApiError(400, "prompt (a string) or messages (a chat) is required", "prompt")
    if has_messages:
        return TokenizeChatRequest, MESSAGES_FIELDS
    return TokenizeCompletionRequest, PROMPT_FIELDS


@dataclass(frozen=True)
class Tokenization:
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        check_model(body.model, self.model_name)
        hf = self.tokenizer.hf
        text = self._render(body) if isinstance(body, TokenizeChatRequest) else body.prompt
        ids = [int(t) for t in hf.encode(text, add_special_tokens=body.add_special_tokens)]
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": [str(s) for s in hf.convert_ids_to_tokens(ids)] if body.return_token_strs else None,
        }

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model, self.model_name)
        vocab = self.tokenizer.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise ApiError(
                    400, f"tokens[{i}]: {token} is not a token id of this model (0..{vocab - 1})", "tokens"
                )
        # Special tokens stay, so detokenize(tokenize(x)) gives x back (vLLM does the same).
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def _render(self, body: TokenizeChatRequest) -> str:
        if body.continue_final_message and body.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if not self.tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template; tokenize a plain prompt", "messages")
        try:  # the same rendering as /v1/chat/completions (tool-call arguments as objects)
            messages = template_messages([m.template_dict() for m in body.messages])
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
        try:
            text = self.tokenizer.hf.apply_chat_template(
                messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tokenize=False,
            )
        except Exception as exc:  # the template's own errors (raise_exception, bad role order, ...)
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ApiError(400, f"cannot apply the chat template: {first_line[:300]}", "messages") from None
        return str(text)
