"""A quantized draft's layers: the packed kernel for few rows, the float weight for many."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, make_llm, mixed_prompts

from specserve.engine import SamplingParams, row_routed_linear
from specserve.engine.memory import module_bytes
from specserve.engine.models import ArchConfig, factory
from specserve.engine.quantization import Int4Linear, quantize_model
from specserve.engine.row_routed_linear import (
    NEVER,
    RowRoutedLinear,
    crossover_rows,
    float_copy_bytes,
    route_rows,
)
from specserve.engine.weight_size import estimate_weight_bytes

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_forwards_of_many_rows_take_the_float_weight():
    torch.manual_seed(0)
    weight = torch.randn(48, 64).to(torch.bfloat16)  # [N, K]
    bias = torch.randn(48).to(torch.bfloat16)
    quantized = Int4Linear.from_float(weight.float(), bias, 32)
    layer = RowRoutedLinear(quantized, weight, bias, min_float_rows=4)
    few = torch.randn(3, 64, dtype=torch.bfloat16)
    many = torch.randn(2, 2, 64, dtype=torch.bfloat16)  # 4 rows under a leading shape
    assert torch.equal(layer(few), quantized(few))
    assert torch.equal(layer(many), torch.nn.functional.linear(many, weight, bias))
    assert not torch.equal(layer(many), quantized(many))  # the two paths differ (int4 codes)


def _timings(monkeypatch, float_wins_at: set[int]) -> None:
    """Fake clock: the float GEMM is faster exactly at the row counts in `float_wins_at`."""

    def fastest(fn, *args, repeats=3):
        rows = args[0].shape[0]
        is_float = fn is torch.nn.functional.linear
        return (1.0 if rows in float_wins_at else 3.0) if is_float else 2.0

    monkeypatch.setattr(row_routed_linear, "_fastest", fastest)


def test_crossover_is_where_the_float_gemm_wins_from_then_on(monkeypatch):
    weight = torch.randn(32, 64).to(torch.bfloat16)
    quantized = Int4Linear.from_float(weight.float(), None, 32)
    _timings(monkeypatch, {4, 12, 16, 24, 32})  # a lucky 4 does not count: 8 lost
    assert crossover_rows(quantized, weight, None) == 12
    _timings(monkeypatch, set())
    assert crossover_rows(quantized, weight, None) == NEVER
    _timings(monkeypatch, set(row_routed_linear.CROSSOVER_ROWS))
    assert crossover_rows(quantized, weight, None) == row_routed_linear.CROSSOVER_ROWS[0]


def _quantized_with_floats(path):
    model = factory.load_decoder(path, torch.bfloat16)
    floats = {
        name: (m.weight.detach(), None if m.bias is None else m.bias.detach())
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    return quantize_model(model, "int4", 64), floats


def test_routed_model_counts_its_float_copies_once(tmp_path, monkeypatch):
    """Qwen2 (qkv biases) with a tied head: the head's float weight is the embedding itself."""
    build_tiny_model(tmp_path, "qwen2", hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    cfg = ArchConfig.from_directory(tmp_path)
    packed_only = estimate_weight_bytes(cfg, torch.bfloat16, "int4", 64, float_linears=False)
    model, floats = _quantized_with_floats(tmp_path)
    monkeypatch.setattr(row_routed_linear, "crossover_rows", lambda *a: 8)
    route_rows(model, floats)
    assert isinstance(model.lm_head, RowRoutedLinear)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert module_bytes(model) == estimate_weight_bytes(
        cfg, torch.bfloat16, "int4", 64, keep_float_linears=True
    )
    assert module_bytes(model) - float_copy_bytes(model) == packed_only  # what a draft step reads


def test_shapes_where_float_never_wins_keep_no_copy(tmp_path, monkeypatch):
    build_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    model, floats = _quantized_with_floats(tmp_path)
    before = module_bytes(model)
    monkeypatch.setattr(row_routed_linear, "crossover_rows", lambda *a: NEVER)
    route_rows(model, floats)
    assert not any(isinstance(m, RowRoutedLinear) for m in model.modules())
    assert module_bytes(model) == before and float_copy_bytes(model) == 0


@pytest.mark.parametrize("min_float_rows", [2, NEVER])
def test_routed_int4_draft_is_lossless(tiny_llama_dir, tiny_draft_dir, monkeypatch, min_float_rows):
    """A catch-up on the prompt runs on the float weights, drafts on the packed ones: the output is
    the float32 target's either way."""
    monkeypatch.setattr(row_routed_linear, "crossover_rows", lambda *a: min_float_rows)
    prompts = mixed_prompts(4, seed=7)
    plain = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_chat_template=False)]
    llm = make_llm(
        tiny_llama_dir,
        speculative_method="draft_model",
        draft_model_path=str(tiny_draft_dir),
        draft_quantization_encoding="int4",
    )
    routed = isinstance(llm.engine.proposer.model.lm_head, RowRoutedLinear)
    assert routed == (min_float_rows < NEVER)
    outs = llm.generate(prompts, GREEDY, use_chat_template=False)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
