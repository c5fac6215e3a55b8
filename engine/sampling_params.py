"""Per-request sampling parameters, validated once at the boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The most draft tokens one verification may carry (k). One name in the code, `num_speculative_tokens`;
# the CLI spells it --max-num-steps (MAX's flag) or --num-speculative-tokens.
MAX_NUM_SPECULATIVE_TOKENS = 32
SPECULATIVE_POLICIES = ("adaptive", "static")
# What a structured-output constraint is written in (engine/grammar.py compiles each with llguidance).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI error bodies carry it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: a JSON schema (text), any JSON object, a regex or a Lark grammar.

    `param` is the request field it came from (response_format, tool_choice, ...): errors name it."""

    kind: str
    value: str = ""
    param: str = "response_format"


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: off; N >= 0: logprob of the chosen token plus N alternatives
    n: int = 1
    # Per-request speculation control (our API extension): None means "engine default".
    speculative_enabled: bool = True
    num_speculative_tokens: int | None = None
    # "adaptive" | "static" | None (the engine's --speculative-policy). Static drafts the cap every step.
    speculative_policy: str | None = None
    # Constrained decoding: every sampled and verified position is masked by this grammar.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidParameterError(param, msg)

        def finite(x: float) -> bool:
            return isinstance(x, int | float) and math.isfinite(x)

        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1")
        check(finite(self.temperature) and self.temperature >= 0, "temperature", "temperature must be >= 0")
        check(finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]")
        check(self.top_k >= -1, "top_k", "top_k must be -1, 0 (disabled) or a positive integer")
        check(finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]")
        check(
            finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "presence_penalty must be in [-2, 2]",
        )
        check(
            finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "frequency_penalty must be in [-2, 2]",
        )
        check(
            finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
            "repetition_penalty",
            "repetition_penalty must be in (0, 10]",
        )
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be in [0, 20]")
        check(1 <= self.n <= 16, "n", "n must be between 1 and 16")
        check(len(self.stop) <= 16, "stop", "at most 16 stop sequences")
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop sequences must be non-empty strings",
        )
        check(
            all(finite(v) and -100 <= v <= 100 for v in self.logit_bias.values()),
            "logit_bias",
            "logit_bias values must be in [-100, 100]",
        )
        check(
            self.num_speculative_tokens is None
            or 0 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"num_speculative_tokens must be in [0, {MAX_NUM_SPECULATIVE_TOKENS}]",
        )
        check(
            self.speculative_policy in (None, *SPECULATIVE_POLICIES),
            "speculative_policy",
            f"speculative policy must be one of {', '.join(SPECULATIVE_POLICIES)}",
        )
        check(
            self.structured_output is None or self.structured_output.kind in GRAMMAR_KINDS,
            self.structured_output.param if self.structured_output else "response_format",
            f"structured output must be one of {', '.join(GRAMMAR_KINDS)}",
        )
        check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
            "seed",
            "seed must be a 64-bit integer",
        )

    def validate_for_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.logit_bias if not 0 <= int(t) < vocab_size]
        if bad:
            raise InvalidParameterError("logit_bias", f"logit_bias token id {bad[0]} outside vocabulary")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameterError("stop_token_ids", f"stop token id {bad[0]} outside vocabulary")
