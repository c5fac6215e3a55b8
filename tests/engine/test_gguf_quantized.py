"""Quantized loading: GGUF Q4 blocks mapped straight to int4 layers, and the packed-layer cache."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from test_gguf_convert import quantize_q4_k, tiny_model, write_gguf
from tiny_models import make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.int4_kernel import default_int4_kernel
from specserve.engine.models.errors import ModelLoadError
from specserve.engine.models.gguf_linear import decode_int4_blocks, read_tensor_index
from specserve.engine.quantization import (
    Int4Linear,
    Int4TiledLinear,
    Int8Linear,
    dequantize_int4,
    int4_from_affine,
    int4_layer_class,
    quantize_int4,
)

Q = gguf.GGMLQuantizationType
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _raw_blocks(x: np.ndarray, qtype: Q) -> np.ndarray:
    return quantize_q4_k(x) if qtype == Q.Q4_K else gguf.quants.quantize(x, qtype)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_q4_blocks_decode_to_the_gguf_values(qtype: Q) -> None:
    x = np.random.default_rng(int(qtype)).standard_normal((6, 512)).astype(np.float32) * 0.05
    raw = _raw_blocks(x, qtype)
    reference = torch.from_numpy(dequantize(raw, qtype))  # [6, 512], the gguf package's decoding
    assert _rel_err(reference, torch.from_numpy(x)) < 0.15  # a real 4-bit quantization of x

    affine = decode_int4_blocks(raw, qtype, 512)

    assert affine.codes.dtype == torch.uint8 and int(affine.codes.max()) <= 15
    assert affine.scales.shape == affine.mins.shape == (6, 512 // 32)
    values = affine.codes.float().reshape(6, 16, 32) * affine.scales[..., None] + affine.mins[..., None]
    torch.testing.assert_close(values.reshape(6, 512), reference, rtol=1e-6, atol=1e-7)
    # In the kernel's form only the bf16 rounding of scale and zero remains: below the error of
    # requantizing the decoded floats (what loading through the bf16 checkpoint used to do; for
    # Q4_1, already a min-max grid per 32, requantizing at g=32 is nearly exact too).
    kernel_form = dequantize_int4(affine.codes, int4_from_affine(affine.scales, affine.mins), 32)
    requantized = dequantize_int4(*quantize_int4(reference.to(torch.bfloat16), 32), 32)
    assert _rel_err(kernel_form, reference) < 0.01
    assert _rel_err(kernel_form, reference) < _rel_err(requantized, reference)


def test_tensor_index_matches_the_gguf_reader(tmp_path: Path) -> None:
    model = tiny_model("qwen2", tied=False, hidden_size=256, intermediate_size=512)
    path = write_gguf(model, tmp_path / "m.gguf", quantize={"model.layers.0.mlp.up_proj.weight": Q.Q4_K})

    arch, infos = read_tensor_index(path)

    reader = gguf.GGUFReader(path)
    assert arch == "qwen2"
    assert [(t.name, t.tensor_type, t.offset) for t in infos] == [
        (t.name, t.tensor_type, t.data_offset) for t in reader.tensors
    ]
    for ours, theirs in zip(infos, reader.tensors, strict=True):
        assert (ours.rows, ours.k) == (int(np.prod(theirs.shape[1:])), int(theirs.shape[0]))
        assert ours.rows * ours.row_bytes == theirs.n_bytes
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        read_tensor_index(truncated)


# A llama (q/k rows permuted in the file) with every kind of source the loader distinguishes.
MIXED = {
    "model.embed_tokens.weight": Q.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q5_0,  # not 4-bit: quantized from float32 at g=32
    "model.layers.0.self_attn.o_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_K,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_K,
    "model.layers.0.mlp.down_proj.weight": Q.Q4_0,
    "model.layers.1.mlp.up_proj.weight": Q.Q8_0,
    "lm_head.weight": Q.Q8_0,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    model = tiny_model("llama", tied=False, hidden_size=256, intermediate_size=512)
    return write_gguf(model, tmp_path_factory.mktemp("mixed") / "mixed.gguf", quantize=MIXED)


def _load(gguf_file: Path, cache: Path, encoding: str, group_size: int = 64):
    spec = ModelSpec(weight_path=str(gguf_file), quantization_encoding=encoding, int4_group_size=group_size)
    return load_model(spec, str(cache)).model


def _weight_through_kernel(layer: torch.nn.Module) -> torch.Tensor:
    """[N, K] as the layer's kernel sees it: the layer applied to the identity."""
    with torch.no_grad():
        return layer(torch.eye(layer.in_features, dtype=torch.bfloat16)).float().t()


def test_gguf_q4_layers_become_int4_without_requantizing(mixed_gguf: Path, tmp_path: Path) -> None:
    exact = _load(mixed_gguf, tmp_path / "f32", "float32")  # the GGUF's own values, q/k un-permuted
    model = _load(mixed_gguf, tmp_path / "c", "int4", group_size=128)

    layer0, layer1 = model.layers[0], model.layers[1]
    # Any 4-bit part puts the fused layer on the GGUF's group of 32; Q8 and float layers use the flag.
    for layer in (layer0.self_attn.qkv_proj, layer0.self_attn.o_proj, layer0.mlp.gate_up_proj):
        assert isinstance(layer, Int4Linear) and layer.group_size == 32
    assert layer1.mlp.gate_up_proj.group_size == 128 and model.lm_head.group_size == 128

    def err(name: str) -> float:
        ours = _weight_through_kernel(model.get_submodule(name))
        return _rel_err(ours, exact.get_submodule(name).weight)

    # Pure Q4 layers keep the file's codes: only bf16 rounding (scales, and the identity-trick
    # output) separates them from the GGUF values. Requantized layers pay a 4-bit step again.
    for name in ("layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"):
        assert err(name) < 0.01, name
    assert err("layers.1.mlp.gate_up_proj") > 0.03
    # q (Q4_K) and k (Q4_0) rows are exact after un-permuting; v (Q5_0) was requantized.
    qkv = _weight_through_kernel(layer0.self_attn.qkv_proj)
    ref = exact.layers[0].self_attn.qkv_proj.weight
    q_and_k = (
        model.config.num_heads * model.config.head_dim + model.config.num_kv_heads * model.config.head_dim
    )
    assert _rel_err(qkv[:q_and_k], ref[:q_and_k]) < 0.01
    assert _rel_err(qkv[q_and_k:], ref[q_and_k:]) > 0.03


def test_gguf_int8_reads_exact_floats(mixed_gguf: Path, tmp_path: Path) -> None:
    exact = _load(mixed_gguf, tmp_path / "f32", "float32")
    model = _load(mixed_gguf, tmp_path / "c", "int8")
    layer = model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, Int8Linear)
    # Per-channel int8 of the exact values: ~0.5% error, no bf16 detour before it.
    assert _rel_err(layer.dequantized_weight(), exact.layers[0].mlp.gate_up_proj.weight) < 0.01


def test_packed_layers_are_cached_per_encoding_and_group(
    mixed_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    first = _load(mixed_gguf, cache, "int4")
    entries = sorted(p.name for p in (cache / "quantized").iterdir())
    assert len(entries) == 1 and "int4g64" in entries[0]

    with caplog.at_level(logging.INFO, logger="specserve.engine"):
        second = _load(mixed_gguf, cache, "int4")
    assert any("loaded packed int4 weights" in r.getMessage() for r in caplog.records)
    for (name, a), (_, b) in zip(first.named_buffers(), second.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name

    _load(mixed_gguf, cache, "int4", group_size=32)
    _load(mixed_gguf, cache, "int8")
    assert len(list((cache / "quantized").iterdir())) == 3
    assert not [p for p in (cache / "quantized").iterdir() if p.name.startswith(".tmp")]


def test_each_int4_layout_has_its_own_cache_entry(
    mixed_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our kernel's tiles where it runs, PyTorch's packing with SPECSERVE_INT4_KERNEL=0: a cache
    entry written in one layout is never read as the other."""
    cache = tmp_path / "cache"
    first = _load(mixed_gguf, cache, "int4")
    monkeypatch.setenv("SPECSERVE_INT4_KERNEL", "0")
    default_int4_kernel.cache_clear()
    try:
        second = _load(mixed_gguf, cache, "int4")
    finally:
        monkeypatch.undo()
        default_int4_kernel.cache_clear()
    tiled = int4_layer_class() is Int4TiledLinear
    assert type(first.lm_head) is (Int4TiledLinear if tiled else Int4Linear)
    assert type(second.lm_head) is Int4Linear
    assert len(list((cache / "quantized").iterdir())) == (2 if tiled else 1)
    x = torch.randn(3, first.lm_head.in_features, generator=torch.Generator().manual_seed(0))
    a, b = first.lm_head(x.to(torch.bfloat16)).double(), second.lm_head(x.to(torch.bfloat16)).double()
    assert ((a - b).abs() <= 2**-7 * a.abs().clamp(min=1e-3)).all()  # one bf16 rounding apart


def test_int4_gguf_model_speculates_losslessly(mixed_gguf: Path, tmp_path: Path) -> None:
    prompts = [[t % 250 for t in p] for p in mixed_prompts(3, seed=11)]  # the vocabulary has 263
    common = dict(quantization_encoding="int4", cache_dir=str(tmp_path / "c"))
    plain = make_llm(mixed_gguf, **common)
    spec = make_llm(mixed_gguf, speculative_method="ngram", num_speculative_tokens=3, **common)
    outs = [
        plain.generate(prompts, GREEDY, use_chat_template=False),
        spec.generate(prompts, GREEDY, use_chat_template=False),
    ]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_an_unwritable_cache_costs_only_the_next_load(
    mixed_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    first = _load(mixed_gguf, cache, "int4")  # converts the GGUF; its packed layers are cached
    blocker = cache / "quantized"
    shutil.rmtree(blocker)
    blocker.write_text("a file where the cache folder should be")

    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        second = _load(mixed_gguf, cache, "int4")

    assert any("could not cache packed weights" in r.getMessage() for r in caplog.records)
    for (name, a), (_, b) in zip(first.named_buffers(), second.named_buffers(), strict=True):
        assert torch.equal(a, b), name
