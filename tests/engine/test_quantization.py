"""Weight-only int8/int4 quantization: kernels vs dequantized references, and lossless speculation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, make_llm, mixed_prompts
from torch import nn

from specserve.engine import SamplingParams
from specserve.engine.quantization import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _reference(x: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The kernels see bf16 activations and a bf16 bias: so does the reference, then float32 math.
    ref = x.to(torch.bfloat16).float() @ w_deq.t()  # [M, N]
    return ref + bias.to(torch.bfloat16).float() if bias is not None else ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "with_bias"), [(48, 64, False), (320, 128, True), (100, 96, True)])
def test_int8_linear_matches_dequantized_reference(n, k, with_bias, dtype):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) * 0.1 if with_bias else None
    x = torch.randn(5, k, generator=g).to(dtype)  # [M, K]
    layer = Int8Linear.from_float(w, bias)
    q, s = quantize_int8(w)
    assert torch.equal(layer.qweight, q) and q.abs().max() <= 127
    out = layer(x)
    assert out.dtype == dtype and out.shape == (5, n)
    assert _rel_err(out, _reference(x, dequantize_int8(q, s), bias)) < 1e-2
    # Quantization error itself: per-channel int8 is within ~1% of the float weight.
    assert _rel_err(dequantize_int8(q, s), w) < 1e-2


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize(("n", "with_bias"), [(64, False), (40, True), (320, False)])
def test_int4_linear_matches_dequantized_reference(group_size, n, with_bias):
    k = 256
    g = torch.Generator().manual_seed(group_size + n)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) * 0.1 if with_bias else None
    x = torch.randn(3, 2, k, generator=g)  # [..., K] float32: cast in and out by the layer
    layer = Int4Linear.from_float(w, bias, group_size)
    q, sz = quantize_int4(w, group_size)
    assert q.min() >= 0 and q.max() <= 15 and sz.shape == (k // group_size, n, 2)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (3, 2, n)  # n=40: padded to 48 inside, sliced
    ref = _reference(x.reshape(-1, k), dequantize_int4(q, sz, group_size), bias).reshape(3, 2, n)
    assert _rel_err(out, ref) < 1e-2
    # 4-bit min-max groups: ~5-10% weight error, smaller groups are closer.
    assert _rel_err(dequantize_int4(q, sz, group_size), w) < 0.1


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_rows_do_not_depend_on_batch(encoding):
    """What lossless speculation rests on: a verification window's rows equal single-token rows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(320, 128, generator=g) * 0.05
    layer = Int8Linear.from_float(w) if encoding == "int8" else Int4Linear.from_float(w, group_size=32)
    x = torch.randn(9, 128, generator=g).to(torch.bfloat16)
    rows = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(layer(x), rows)


def test_quantize_model_replaces_every_linear_and_unties_head(tmp_path):
    from specserve.engine.models.factory import load_decoder

    build_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True)  # Qwen2: qkv bias, tied head
    model = load_decoder(tmp_path, torch.bfloat16)
    embed_before = model.embed_tokens.weight.clone()
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
    logits_before = model.compute_logits(hidden)
    quantize_model(model, "int4", group_size=128)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # hidden 64 < 128: the fallback picks the largest group that divides in_features.
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.group_size == 64
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert isinstance(model.embed_tokens, nn.Embedding) and torch.equal(
        model.embed_tokens.weight, embed_before
    )
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and _rel_err(logits, logits_before.float()) < 0.15
    with pytest.raises(ValueError):
        quantize_model(model, "int3")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """Qwen2 layout (qkv bias), dims that fit every int4 group size, tied head."""
    path = tmp_path_factory.mktemp("tiny-qwen-q")
    build_tiny_model(path, "qwen2", hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    return path


def _generate(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)]


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_quantized_target_speculation_is_lossless(qwen_dir, encoding):
    prompts = mixed_prompts(4, seed=3)
    plain = _generate(make_llm(qwen_dir, quantization_encoding=encoding), prompts)
    ngram = make_llm(qwen_dir, quantization_encoding=encoding, speculative_method="ngram")
    assert _generate(ngram, prompts) == plain
    draft = make_llm(
        qwen_dir,
        quantization_encoding=encoding,
        speculative_method="draft_model",
        draft_model_path=str(qwen_dir),
        draft_quantization_encoding="int4",
        num_speculative_tokens=4,
    )
    assert isinstance(draft.engine.model.lm_head, Int8Linear if encoding == "int8" else Int4Linear)
    assert _generate(draft, prompts) == plain


def test_int4_draft_keeps_float32_target_output(tiny_llama_dir, tiny_draft_dir):
    prompts = mixed_prompts(4, seed=5)
    plain = _generate(make_llm(tiny_llama_dir), prompts)
    llm = make_llm(
        tiny_llama_dir,
        speculative_method="draft_model",
        draft_model_path=str(tiny_draft_dir),
        draft_quantization_encoding="int4",
    )
    head = (
        llm.engine.proposer.model.lm_head
    )  # routed or not by this machine's timings (test_row_routed_linear)
    assert isinstance(getattr(head, "quantized", head), Int4Linear)
    assert next(llm.engine.model.parameters()).dtype == torch.float32
    outs = llm.generate(prompts, GREEDY, use_chat_template=False)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0  # the int4 draft is actually used


def test_quantized_target_verifies_one_kernel_tile_by_default():
    from specserve.engine.config import EngineConfig, ModelSpec

    def k(encoding: str, explicit: int | None = None, policy: str = "static") -> int | None:
        spec = ModelSpec(quantization_encoding=encoding)
        config = EngineConfig(model=spec, num_speculative_tokens=explicit, speculative_policy=policy)
        return config.num_speculative_tokens

    assert k("bfloat16") == k("float32") == 5
    assert k("int4") == k("int8") == 3  # k + 1 = 4 rows: one tile of the int4/int8 CPU kernels
    assert k("int4", explicit=5) == 5 and k("bfloat16", explicit=0) == 0
    # Adaptive (the default): K is a cap the controller drafts up to; two int4 tiles at most.
    assert k("bfloat16", policy="adaptive") == 8
    assert k("int4", policy="adaptive") == 7
    assert EngineConfig().num_speculative_tokens == 8
