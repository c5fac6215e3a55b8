"""GGUF metadata -> Hugging Face config.json / generation_config.json, and GGUF -> HF tensor names.

Only the Llama family the decoder implements is accepted. The keys follow llama.cpp's
`convert_hf_to_gguf.py` (`{arch}.embedding_length`, `tokenizer.ggml.eos_token_id`, ...).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from .errors import ModelLoadError

# GGUF `general.architecture` -> (HF model_type, HF architectures entry). SmolLM and TinyLlama are `llama`.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# llama.cpp permutes the q/k rows of these (its RoPE pairs adjacent dims; HF pairs halves). Qwen's
# converters do not, so un-permuting a qwen2/qwen3 file would scramble it.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral"})

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Consumed into config.json (llama3 rope scaling) rather than written as a weight.
ROPE_FREQS = "rope_freqs.weight"
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# Texts llama.cpp also treats as end-of-generation; Qwen stops on both <|im_end|> and <|endoftext|>.
_EOG_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
)
_CONTROL_TOKEN = 3  # llama.cpp token type CONTROL


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def architecture_of(reader: GGUFReader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    return arch


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    # Dropping an unknown tensor silently would give a model that talks nonsense.
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in the supported decoders")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: per head, rows were reordered (2, d/2) -> (d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency divisors.

    llama.cpp stores 1 for high frequencies, `factor` for low ones and a smooth ramp between; we try
    the published Llama 3.x parameters (only `factor` differs) and refuse anything else rather than guess.
    """
    factor = float(freqs.max())
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for low, high, orig in ((1.0, 4.0, 8192),):
        wavelen = 2 * np.pi / inv_freq
        smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
        expected = 1.0 / ((1 - smooth) / factor + smooth)
        if freqs.shape == expected.shape and np.allclose(freqs, expected, rtol=1e-3):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ModelLoadError("GGUF rope_freqs tensor does not match llama3 rope scaling; unsupported")


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "type": kind,
        "factor": float(field(reader, f"{arch}.rope.scaling.factor", 1.0)),
    }
    orig = field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def stop_token_ids(reader: GGUFReader) -> list[int]:
    """EOS first, then other end-of-generation tokens the vocabulary marks as control tokens."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tid = field(reader, key)
        if tid is not None and int(tid) not in ids:
            ids.append(int(tid))
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    types = field(reader, "tokenizer.ggml.token_type") or []
    index = {t: i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    for text in _EOG_TEXTS:
        i = index.get(text)
        if i is not None and i < len(types) and types[i] == _CONTROL_TOKEN and i not in ids:
            ids.append(i)
    return ids


def build_configs(
    reader: GGUFReader, arch: str, dtype: torch.dtype, rope_freqs: np.ndarray | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) contents from the GGUF metadata and tensor shapes."""
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")

    def req(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    dtype_name = str(dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 4096)),
        # The embedding's row count is the truth: Qwen pads it past the tokenizer's length.
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    scaling = _rope_scaling(reader, arch)
    if rope_freqs is not None:
        scaling = _llama3_rope_scaling(rope_freqs, head_dim, rope_theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
        tid = field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if tid is not None:
            config[f"{hf_key}_token_id"] = int(tid)

    generation: dict[str, Any] = {"eos_token_id": stop_token_ids(reader)}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            generation[key] = config[key]
    return config, generation
