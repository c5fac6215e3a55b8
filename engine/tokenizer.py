"""Tokenizer loading, chat templates and the set of stop (EOS) token ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# End-of-turn markers that chat models emit; any of them present in the vocabulary stops generation.
_KNOWN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


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

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)
