"""Incremental detokenization: multi-byte UTF-8, never half a character, stop strings cut."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode as transformers_bytes_to_unicode

from specserve.engine.detokenizer import IncrementalDetokenizer, LogprobText
from specserve.engine.tokenizer import Tokenizer, bytes_to_unicode


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


def _splits_a_character(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_are_the_real_bytes_and_join_to_the_text(tokenizer, text):
    raws = [tokenizer.token_bytes(t) for t in tokenizer.encode(text)]
    assert b"".join(raws) == text.encode()
    assert all(r != "\ufffd".encode() for r in raws)


def test_logprob_texts_join_and_a_split_character_keeps_its_bytes(tokenizer):
    text = "日本語のテキストも少し。"
    ids = tokenizer.encode(text)
    texts = LogprobText(tokenizer)
    pieces = [texts.add(t) for t in ids]
    assert "".join(t for t, _ in pieces) == text and texts.offset == len(text)
    split = [(t, raw) for t, raw in pieces if _splits_a_character(raw)]
    assert split  # the tiny vocabulary splits some of these characters across tokens
    assert all(raw[0] >= 0x80 for _, raw in split)  # real UTF-8 bytes, not U+FFFD's [239, 191, 189]


def test_peek_scores_an_alternative_without_moving_on(tokenizer):
    ids = tokenizer.encode("日本")
    texts = LogprobText(tokenizer)
    first = texts.add(ids[0])
    assert texts.peek(ids[1]) == texts.peek(ids[1])
    assert "".join([first[0], texts.add(ids[1])[0], *(texts.add(t)[0] for t in ids[2:])]) == "日本"


def test_byte_table_matches_transformers():
    assert bytes_to_unicode() == transformers_bytes_to_unicode()


def test_sentencepiece_byte_fallback_pieces_are_bytes(tmp_path):
    """Llama-2 / Mistral style vocabularies: '▁' is a space and <0xNN> pieces are single bytes."""
    pieces = ["<unk>", "\u2581", "h", "i", "\u2581h", "\u2581hi", *(f"<0x{b:02X}>" for b in range(256))]
    merges = [("\u2581", "h"), ("\u2581h", "i")]
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True)
    raw = RawTokenizer(bpe)
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = tok.hf.encode("hi \u306e", add_special_tokens=False)
    assert [tok.token_bytes(t) for t in ids] == [b" hi", b" ", b"\xe3", b"\x81", b"\xae"]
