"""GGUF -> HF conversion on tiny random models written with the gguf package's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specserve.engine.models import gguf_convert
from specserve.engine.models.loader import ModelLoadError, resolve_model

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w"]


def _vocab() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, ChatML control tokens."""
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3 = CONTROL
    return tokens, types


VOCAB = len(_vocab()[0])


def tiny_model(arch: str, *, tied: bool, **overrides: int) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    common.update(overrides)
    config = {
        "llama": lambda: LlamaConfig(**common),
        "qwen2": lambda: Qwen2Config(**common),
        "qwen3": lambda: Qwen3Config(head_dim=32, **common),  # head_dim != hidden/heads
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute, as it is applied to llama q/k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (rows of multiples of 256) -> raw blocks [rows, K/256 * 144] uint8.

    Per 32-weight sub-block: min-max to codes 0..15; the eight sub-block scales and mins are then
    quantized to 6 bits against the block's f16 d and dmin, and packed as llama.cpp packs them."""
    rows, k = x.shape
    sub = x.astype(np.float32).reshape(-1, 8, 32)  # [B, 8, 32]
    lo = np.minimum(sub.min(axis=2), 0)  # [B, 8]
    scale = np.maximum(sub.max(axis=2) - lo, 1e-8) / 15
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16)  # [B, 1]
    dmin = np.maximum((-lo).max(axis=1, keepdims=True) / 63, 1e-8).astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round((sub + offset) / step), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    packed = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )  # [B, 12]
    qs = q[:, :, 0] | (q[:, :, 1] << 4)  # [B, 4, 32]: sub-block 2j in low nibbles, 2j+1 in high
    blocks = np.concatenate(
        [d.view(np.uint8), dmin.view(np.uint8), packed, qs.reshape(-1, 128)], axis=1
    )  # [B, 144]
    return blocks.reshape(rows, k // 256 * 144)


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    *,
    arch: str | None = None,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra_metadata: bool = True,
) -> Path:
    """Write `model` as llama.cpp would: its names, metadata keys, q/k permutation for llama."""
    cfg = model.config
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test-model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    if getattr(cfg, "head_dim", None) and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if extra_metadata:
        tokens, types = _vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim % 2 == 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().copy()
        if arch in ("llama", "mistral") and ".q_proj." in name:
            data = _permute(data, cfg.num_attention_heads)
        elif arch in ("llama", "mistral") and ".k_proj." in name:
            data = _permute(data, cfg.num_key_value_heads)
        qtype = (quantize or {}).get(name)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(_gguf_name(name), data.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.Q4_K:  # the gguf package only dequantizes K-quants
            w.add_tensor(_gguf_name(name), quantize_q4_k(data), raw_dtype=qtype)
        elif qtype is not None:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_dir_state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(f))
    return state


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_gguf_tensors_config_and_logits_match(tmp_path: Path, arch: str, tied: bool) -> None:
    model = tiny_model(arch, tied=tied)
    gguf_file = write_gguf(model, tmp_path / f"tiny-{arch}.gguf")

    resolved = resolve_model(None, str(gguf_file), dtype=torch.float32, cache_dir=tmp_path / "cache")

    assert resolved.source == "gguf"
    ours = load_dir_state(resolved.directory)
    ref = model.state_dict()
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)

    config = json.loads((resolved.directory / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["tie_word_embeddings"] is tied
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == VOCAB

    # End to end: transformers reads our config + weights and computes the same logits.
    loaded = AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 7, 42]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_gguf_tokenizer_has_chat_template_and_stop_tokens(tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model("qwen2", tied=True), tmp_path / "tiny.gguf")
    directory = resolve_model(str(gguf_file), cache_dir=tmp_path / "cache").directory

    tok = AutoTokenizer.from_pretrained(directory)
    tokens, _ = _vocab()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tokens.index("<|im_end|>")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokens.index("<|im_start|>")  # special tokens stay whole
    assert tokens.index("hell") in ids  # merges apply
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]


def test_gguf_quantized_chunked_and_sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny limits force several row chunks per tensor and several shards + an index.
    monkeypatch.setattr(gguf_convert, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 40_000)
    model = tiny_model("llama", tied=False)
    q8, f16, bf16 = (
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
    )
    quantized = {
        "model.embed_tokens.weight": q8,
        "model.layers.0.mlp.up_proj.weight": q8,
        "lm_head.weight": q8,
        "model.layers.1.self_attn.q_proj.weight": q8,  # permuted and quantized
        "model.layers.0.mlp.down_proj.weight": f16,
        "model.layers.1.mlp.gate_proj.weight": bf16,
    }
    gguf_file = write_gguf(model, tmp_path / "tiny-q8.gguf", quantize=quantized)

    directory = resolve_model(None, str(gguf_file), dtype=torch.bfloat16, cache_dir=tmp_path / "c").directory

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours = load_dir_state(directory)
    assert set(index["weight_map"]) == set(ours)
    for name, ref in model.state_dict().items():
        assert ours[name].dtype == torch.bfloat16
        # Q8_0 costs ~1% of the tensor's range; unquantized tensors only lose the bf16 rounding.
        atol = 0.02 * float(ref.abs().max()) if quantized.get(name) == q8 else 0.0
        torch.testing.assert_close(ours[name].float(), ref.to(torch.bfloat16).float(), rtol=0.01, atol=atol)


def test_gguf_cache_is_reused(tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model("llama", tied=True), tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = resolve_model(None, str(gguf_file), dtype=torch.float32, cache_dir=cache).directory
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    second = resolve_model(
        str(tmp_path), dtype=torch.float32, cache_dir=cache
    ).directory  # the folder holding it

    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (cache / "converted").iterdir()] == [first.name]  # no temp dir left behind
    # Another dtype is another cache entry.
    third = resolve_model(None, str(gguf_file), dtype=torch.float16, cache_dir=cache).directory
    assert third != first and load_dir_state(third)["model.norm.weight"].dtype == torch.float16


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    gguf_file = write_gguf(tiny_model("llama", tied=True), tmp_path / "gpt.gguf", arch="gptneox")
    with pytest.raises(
        ModelLoadError, match=r"'gptneox' is not supported \(supported: llama, mistral, qwen2, qwen3\)"
    ):
        resolve_model(None, str(gguf_file), cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "converted").iterdir())


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_gguf_corrupted_file_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    gguf_file = write_gguf(tiny_model("llama", tied=True), tmp_path / "bad.gguf")
    raw = gguf_file.read_bytes()
    if damage == "truncate":
        gguf_file.write_bytes(raw[: len(raw) - 5000])
    elif damage == "garbage":
        gguf_file.write_bytes(b"NOPE" + raw[4:])
    else:
        gguf_file.write_bytes(b"")

    with pytest.raises(ModelLoadError) as err:
        resolve_model(None, str(gguf_file), cache_dir=tmp_path / "cache")

    message = str(err.value)
    assert "\n" not in message and "bad.gguf" in message
    assert ("truncated" in message) if damage == "truncate" else ("not a valid GGUF" in message)
    assert not any((tmp_path / "cache" / "converted").iterdir())  # nothing half-written is kept


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_file = write_gguf(tiny_model("llama", tied=True), tmp_path / "tiny.gguf")

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(None, str(gguf_file), cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "converted").iterdir())


def test_several_gguf_files_in_a_directory_is_an_error(tmp_path: Path) -> None:
    model = tiny_model("llama", tied=True)
    write_gguf(model, tmp_path / "a.gguf")
    write_gguf(model, tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        resolve_model(str(tmp_path), cache_dir=tmp_path / "cache")
