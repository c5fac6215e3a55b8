"""Incremental detokenization: multi-byte UTF-8, never half a character, stop strings cut."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return Tokenizer(path)


TEXTS = [
    "Bonjour, comment ça va? Très bien!",
    "日本語のテキストも少し。",
    "emoji 🚀 and ünïcödé",
    "plain words only",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], [])
    pieces = []
    for t in ids:
        detok.add_token(t)
        piece = detok.take_delta(finished=False)
        assert "\ufffd" not in piece  # never half a character
        pieces.append(piece)
    pieces.append(detok.take_delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_stop_string_across_tokens_is_cut_and_held_back(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], ["fox jumps"])
    streamed = ""
    stopped = False
    for t in ids:
        stopped = detok.add_token(t)
        streamed += detok.take_delta(finished=stopped)
        assert "fox j" not in streamed  # a partial stop string is never emitted... nor the full one
        if stopped:
            break
    assert stopped
    assert streamed == "The quick brown "
