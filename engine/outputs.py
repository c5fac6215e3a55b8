"""What the engine hands back per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # Cumulative speculation stats of this request
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_forced_tokens: int = 0  # accepted drafts a grammar forced (structured output)
    # Decode steps and the drafts allowed in them (k, 0 included): mean k = sum_k / num_k_decisions.
    num_k_decisions: int = 0
    sum_k: int = 0
    error: str | None = None
