"""Tokenizer loading, chat templates, the set of stop (EOS) token ids and each token's raw bytes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# End-of-turn markers that chat models emit; any of them present in the vocabulary stops generation.
_KNOWN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")

_SPM_SPACE = "\u2581"  # sentencepiece's visible space
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback piece


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table that byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM)
    are written in: printable Latin-1 bytes stand for themselves, the other 68 (controls, space, ...)
    map to U+0100 onwards in byte order. transformers has the same table, but at a path that moved
    between major versions."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1)]
    printable += range(ord("\xae"), ord("\xff") + 1)
    table = {b: chr(b) for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + i)
    return table


def _decoder_types(hf: PreTrainedTokenizerBase) -> set[str]:
    """Types of the fast tokenizer's decoder and of any decoders nested in a Sequence."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return set()

    def walk(node: dict[str, Any]) -> Iterator[str]:
        yield node.get("type", "")
        for child in node.get("decoders") or []:
            yield from walk(child)

    return set(walk(json.loads(backend.decoder.__getstate__())))


def _byte_level_piece(table: dict[str, int]) -> Callable[[str], bytes | None]:
    def piece_bytes(piece: str) -> bytes | None:
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None

    return piece_bytes


def _sentencepiece_piece(piece: str) -> bytes | None:
    if match := _SPM_BYTE.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    return piece.replace(_SPM_SPACE, " ").encode()


def piece_decoder(hf: PreTrainedTokenizerBase) -> Callable[[str], bytes | None] | None:
    """vocabulary piece -> the bytes it stands for; None when this vocabulary's pieces are not bytes."""
    types = _decoder_types(hf)
    if "ByteLevel" in types:
        return _byte_level_piece({c: b for b, c in bytes_to_unicode().items()})
    if types & {"ByteFallback", "Metaspace", "Replace"}:
        return _sentencepiece_piece
    return None


class Tokenizer:
    def __init__(self, directory: Path, config_eos_ids: tuple[int, ...] = ()):
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory))
        eos: set[int] = set(config_eos_ids)
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        gen_cfg = Path(directory) / "generation_config.json"
        if gen_cfg.exists():
            value = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update(value if isinstance(value, list) else [value] if value is not None else [])
        vocab = self.hf.get_vocab()
        eos.update(vocab[t] for t in _KNOWN_END_TOKENS if t in vocab)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._piece_bytes = piece_decoder(self.hf)
        # Added tokens (<|im_end|>, ...) are stored verbatim, not in the vocabulary's byte alphabet.
        self._added = {i: t.content for i, t in self.hf.added_tokens_decoder.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    @property
    def chat_template(self) -> str:
        template = getattr(self.hf, "chat_template", None) or ""
        return template if isinstance(template, str) else json.dumps(template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        ids: Any = self.hf.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to the output; may be part of a UTF-8 character (OpenAI's `bytes`)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        raw = None
        if self._piece_bytes is not None:
            raw = self._piece_bytes(str(self.hf.convert_ids_to_tokens(token_id)))
        if raw is None:  # e.g. WordPiece: no byte alphabet, decode the token alone
            raw = self.decode([token_id], skip_special_tokens=False).encode()
        return raw
