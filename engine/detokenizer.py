"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte UTF-8 characters that byte-level BPE splits across tokens,
so each step decodes a short window and only emits text once it no longer ends in U+FFFD. Stop strings
are matched on the accumulated text (so they work across token boundaries); while a request runs,
the last len(longest stop)-1 characters are held back so a partial stop string is never streamed.
`LogprobText` gives each token of a logprobs payload its real bytes and a text that joins up.
"""

from __future__ import annotations

import codecs

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


class LogprobText:
    """Bytes and text of each generated token for logprobs, in generation order.

    A token's text is what its bytes add to the UTF-8 text of the tokens before it: a token ending
    inside a multi-byte character adds "" and the token that completes it adds the whole character,
    so the texts of consecutive tokens join to the generated text (special tokens aside) and `bytes`
    carry the token's real bytes (OpenAI's field), never those of U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0  # characters of text produced so far (the next token's text_offset)

    def add(self, token_id: int) -> tuple[str, bytes]:
        """The generated token at the current position: its text and bytes; advances the position."""
        raw = self.tokenizer.token_bytes(token_id)
        text = self._utf8.decode(raw)
        self.offset += len(text)
        return text, raw

    def peek(self, token_id: int) -> tuple[str, bytes]:
        """An alternative at the current position: what it would have added; the position stays."""
        state = self._utf8.getstate()
        raw = self.tokenizer.token_bytes(token_id)
        text = self._utf8.decode(raw)
        self._utf8.setstate(state)
        return text, raw
