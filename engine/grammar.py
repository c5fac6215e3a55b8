"""Structured output: one llguidance matcher per constrained request, and the token masks it gives.

Why llguidance (not xgrammar, not our own): it is a dependency-free wheel (Rust, abi3; xgrammar pulls
in its own torch requirement, which fights our pinned CPU torch), it computes a mask in ~30-50 us on a
150k vocabulary, it compiles JSON schemas, regexes and Lark grammars (with JSON schemas embedded in
Lark, which is how tool calls are forced), and it has the three operations speculation needs:
`validate_tokens` (how many drafts the grammar admits), `rollback` (undo rejected drafts) and
`compute_ff_tokens` (tokens the grammar forces: free drafts).

The matcher follows the request's committed output only. A verification window's masks are computed
by consuming its drafts tentatively, one mask per position, then rolling them back; the emitted
tokens are consumed once verification has decided them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from .sampling_params import InvalidParameterError, StructuredOutput

logger = logging.getLogger("specserve.engine")

# Forced tokens proposed in one window at most: each still costs a verification row.
MAX_FORCED_TOKENS = 16
# JSON without optional whitespace (`{"a":1,"b":[2]}`): small models otherwise pad with whitespace runs,
# and fixed separators make key names and punctuation forced tokens. A schema's "x-guidance" overrides.
JSON_DEFAULTS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions (a TypedDict)


def grammar_source(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for a constraint; raises InvalidParameterError."""
    try:
        if spec.kind == "json_schema":
            schema: Any = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.value)
    except ValueError as exc:
        raise InvalidParameterError(spec.param, f"invalid {spec.kind}: {exc}") from None
    raise InvalidParameterError(spec.param, f"unknown structured output kind {spec.kind!r}")


def check_structured_output(spec: StructuredOutput) -> str:
    """Compile and validate without a tokenizer (cheap, safe on the event loop); the grammar source."""
    source = grammar_source(spec)
    problem = LLMatcher.validate_grammar(source)
    if problem:
        raise InvalidParameterError(spec.param, f"invalid {spec.kind}: {problem.splitlines()[0][:300]}")
    return source


class GrammarCompiler:
    """Builds matchers for one tokenizer. The llguidance tokenizer takes 0.7 s (49k vocabulary) to
    3.5 s (152k) to build, so it is built once, in a background thread started with the engine."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]):
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True).start()

    def _build(self) -> None:
        try:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        except BaseException as exc:  # reported to the first request that needs it
            self._error = exc
        finally:
            self._ready.set()

    def tokenizer(self) -> LLTokenizer:
        self._ready.wait()
        if self._tokenizer is None:
            raise InvalidParameterError(
                "response_format", f"structured output is unavailable for this tokenizer: {self._error}"
            )
        return self._tokenizer

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        source = check_structured_output(spec)
        matcher = LLMatcher(self.tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(spec.param, f"invalid {spec.kind}: {matcher.get_error()[:300]}")
        return GrammarMatcher(matcher, self.vocab_size)


def _timed(method: Callable) -> Callable:
    """Add the call's duration to the matcher's `seconds` (what structured output costs a request)."""

    @wraps(method)
    def run(self: GrammarMatcher, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    return run


class GrammarMatcher:
    """The grammar state after a request's committed output."""

    def __init__(self, matcher: LLMatcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self.dead_end_logged = False
        self.seconds = 0.0  # time spent in masks, draft checks and commits (the mask's cost per step)

    @property
    def is_dead(self) -> bool:
        """The grammar can go no further (an error, or nothing but EOS is left and was consumed)."""
        return self._m.is_error() or (self._m.is_stopped() and not self._m.is_accepting())

    @property
    def is_finished(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    @_timed
    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar admits next (columns past the tokenizer's are False)."""
        return self._mask()

    def _mask(self) -> torch.Tensor:  # untimed: the timed entry points call it
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size]  # bit t of word w: token 32w+t
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[: mask.shape[0]] = torch.from_numpy(mask.astype(bool))
        return out

    @_timed
    def window_masks(self, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, V] bool: the mask at each position of a verification window whose drafts
        the grammar admits (valid_prefix), computed by consuming them tentatively and rolling back."""
        rows = [self._mask()]
        consumed = 0
        for token in drafts:
            if not self._m.consume_token(token):
                break
            consumed += 1
            rows.append(self._mask())
        if consumed:
            self._m.rollback(consumed)
        while len(rows) < len(drafts) + 1:  # never reached for admitted drafts; keeps the shape
            rows.append(rows[-1])
        return torch.stack(rows)

    @_timed
    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar admits from the committed state."""
        return int(self._m.validate_tokens(tokens)) if tokens else 0

    @_timed
    def forced_after(self, prefix: list[int], limit: int) -> list[int]:
        """Tokens the grammar forces after `prefix` (which it must admit), at most `limit`."""
        if limit <= 0:
            return []
        if prefix and not self._m.consume_tokens(prefix):
            return []
        forced = list(self._m.compute_ff_tokens())[:limit]
        if prefix:
            self._m.rollback(len(prefix))
        return forced

    @_timed
    def commit(self, tokens: list[int]) -> bool:
        """Consume emitted tokens; False when the grammar rejects one (then it is dead)."""
        return bool(self._m.consume_tokens(tokens)) if tokens else True
