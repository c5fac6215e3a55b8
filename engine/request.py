"""A request's state as it moves through the engine (no torch here: the scheduler is pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams
from .stats import SpecDecodingStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or max length reached
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # an internal fault in this request only


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Target KV: tokens [0, num_computed_tokens) are in the cache.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at admission
    num_preemptions: int = 0
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Structured output: the engine's grammar matcher (engine/grammar.py), opaque to the scheduler,
    # and how many tokens the grammar forces next (the scheduler reserves draft slots for them).
    grammar: Any = None
    num_forced_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def in_decode(self) -> bool:
        """True when only the last sampled token is missing from the KV cache."""
        return self.num_computed_tokens == self.num_tokens - 1 and bool(self.output_token_ids)

    def max_new_tokens_left(self, max_length: int) -> int:
        by_params = self.params.max_tokens - len(self.output_token_ids) if self.params.max_tokens else 1 << 30
        return min(by_params, max_length - self.num_tokens)
