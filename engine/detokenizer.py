"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte UTF-8 characters that byte-level BPE splits across tokens,
so each step decodes a short window and only emits text once it no longer ends in U+FFFD. Stop strings
are matched on the accumulated text (so they work across token boundaries); while a request runs,
the last len(longest stop)-1 characters are held back so a partial stop string is never streamed.
"""

from __future__ import annotations

from .tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens used as left context so the first word's spacing decodes right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (stop string cut once matched)
        self.emitted = 0  # characters of self.text already handed out

    def add_token(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string completed (text is already cut)."""
        self.tokens.append(token_id)
        prefix_text = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # mid-character, or a token that decodes to nothing (special token)
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stop:
            # A stop string may begin up to holdback characters before this delta.
            search_from = max(0, start - self.holdback)
            hits = [i for s in self.stop if (i := self.text.find(s, search_from)) != -1]
            if hits:
                self.text = self.text[: min(hits)]
                return True
        return False

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
