"""The tiled int4 kernel (engine/int4_matmul.c): its layout, its answers against float64 and against
PyTorch's int4 kernel, a row's independence of its batch, and the fallback where it cannot run."""

from __future__ import annotations

import pytest
import torch

from specserve.engine import int4_kernel
from specserve.engine.c_library import KernelBuildError
from specserve.engine.int4_kernel import build_int4_kernel, pack_int4_tiles
from specserve.engine.quantization import (
    Int4Linear,
    Int4TiledLinear,
    dequantize_int4,
    int4_layer_class,
    quantize_int4,
    quantize_weight,
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    try:
        return build_int4_kernel(tmp_path_factory.mktemp("int4"))
    except KernelBuildError as e:  # a machine without AVX512-BF16: the fallback tests below still run
        pytest.skip(str(e))


def _layer(n: int, k: int, group: int, seed: int, bias: bool = False) -> tuple[Int4TiledLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    q, sz = quantize_int4(w, group)
    return Int4TiledLinear.from_codes(q, sz, group, b), dequantize_int4(q, sz, group)


def test_packed_words_hold_each_pair_in_one_lane():
    q = torch.randint(0, 16, (20, 16), generator=torch.Generator().manual_seed(1))  # N=20: two tiles
    sz = torch.rand(16 // 16, 20, 2)
    packed, tiled = pack_int4_tiles(q, sz)
    assert packed.shape == (2, 2, 16) and tiled.shape == (2, 1, 2, 16)
    for n, k in [(0, 0), (3, 5), (17, 14), (19, 15)]:
        word = int(packed[n // 16, k // 8, n % 16]) & 0xFFFFFFFF
        i, second = (k % 8) // 2, k % 2
        assert (word >> (16 * second + 4 * i)) & 0xF == q[n, k]
    assert packed[1, :, 4:].eq(0).all() and tiled[1, :, :, 4:].eq(0).all()  # padded channels
    assert torch.equal(tiled[0, 0, 0], sz[0, :16, 0].to(torch.bfloat16))
    assert torch.equal(tiled[1, 0, 1, :4], sz[0, 16:, 1].to(torch.bfloat16))


@pytest.mark.parametrize(("n", "k", "group"), [(48, 64, 32), (40, 576, 64), (100, 256, 128), (17, 96, 32)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9])
def test_matches_float64_as_closely_as_pytorchs_kernel(kernel, n, k, group, rows):
    layer, w_deq = _layer(n, k, group, seed=n + k + rows)
    torch_layer = Int4Linear.from_codes(*quantize_int4(w_deq, group), group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    ref = x.double() @ w_deq.double().t()  # [M, N]
    ours, theirs = layer(x), torch_layer(x)
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    ours_err, theirs_err = (ours.double() - ref).abs(), (theirs.double() - ref).abs()
    # Float32 sums of exact products, rounded once to bf16: within half a bf16 step (<= 2^-8 relative)
    # of the exact answer, and on average no farther from it than PyTorch's kernel.
    assert (ours_err <= ref.abs() * 2**-8 * 1.001 + 1e-6).all()
    assert ours_err.mean() <= theirs_err.mean() * 1.05


def test_bias_is_added_after_the_product(kernel):
    layer, w_deq = _layer(40, 128, 32, seed=5, bias=True)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    product = (x.double() @ w_deq.double().t()).to(torch.bfloat16)  # what the kernel returns
    assert torch.equal(layer(x), product + layer.bias)


@pytest.mark.parametrize(("n", "k", "group"), [(40, 576, 64), (320, 128, 32), (33, 256, 128)])
def test_a_row_does_not_depend_on_its_batch(kernel, n, k, group):
    """What lossless speculation with an int4 target rests on: window rows equal one-token rows."""
    layer, _ = _layer(n, k, group, seed=7)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(11)])
    for rows in (2, 4, 5, 11):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer(x[6:11])[-1], alone[10])  # a window's last row


def test_groups_the_kernel_cannot_sum_are_refused(kernel):
    q = torch.zeros(16, 48, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 16 inputs, not 24"):
        Int4TiledLinear.from_codes(q, torch.ones(2, 16, 2), 24)
    with pytest.raises(ValueError, match="do not match"):
        Int4TiledLinear.from_codes(q, torch.ones(3, 16, 2), 24)


def test_a_nan_row_spoils_only_itself(kernel):
    layer, _ = _layer(64, 128, 32, seed=2)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[2, 7] = float("nan")
    out = layer(x)
    assert out[2].isnan().all() and not out[[0, 1, 3, 4]].isnan().any()


def test_float32_callers_and_leading_dimensions(kernel):
    layer, w_deq = _layer(40, 64, 32, seed=4)
    x = torch.randn(2, 3, 64)  # float32, [..., K]
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 40)
    ref = x.to(torch.bfloat16).double().reshape(6, 64) @ w_deq.double().t()
    assert torch.allclose(out.reshape(6, 40).double(), ref, atol=1e-2, rtol=1e-2)


def test_layers_take_the_tiled_kernel_where_it_runs(kernel):
    layer = quantize_weight(torch.randn(64, 128), None, "int4", 64)
    assert isinstance(layer, Int4TiledLinear) and "tiled kernel" in repr(layer)
    # Same bytes as PyTorch's layout (start-up sizes the model before loading it).
    buffers = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales_and_zeros))
    torch_layer = Int4Linear.from_float(torch.randn(64, 128), None, 64)
    assert buffers == sum(
        t.numel() * t.element_size() for t in (torch_layer.qweight, torch_layer.scales_and_zeros)
    )


def test_switched_off_int4_layers_keep_pytorchs_kernel(switch_kernel_off):
    switch_kernel_off("SPECSERVE_INT4_KERNEL", int4_kernel.default_int4_kernel)
    assert int4_kernel.default_int4_kernel() is None and int4_layer_class() is Int4Linear
    layer = quantize_weight(torch.randn(64, 128), None, "int4", 64)
    assert type(layer) is Int4Linear
    with pytest.raises(RuntimeError, match="int4 kernel is not available"):
        Int4TiledLinear.from_float(torch.randn(64, 128), None, 64)


def test_a_build_without_avx512_bf16_is_refused(tmp_path):
    with pytest.raises(KernelBuildError, match="needs AVX512-BF16"):
        build_int4_kernel(tmp_path, defines=("SPECSERVE_GENERIC",))


def _int8_rows_reference(x: torch.Tensor, w_deq: torch.Tensor, group: int) -> torch.Tensor:
    """What the VNNI path computes, in float64: each row's groups rounded to int8 at peak / 127
    (float32 arithmetic, ties to even), times the dequantized weight."""
    m, k = x.shape
    xf = x.float().reshape(m, k // group, group)
    peak = xf.abs().amax(dim=-1, keepdim=True)  # [M, G, 1]
    inverse = torch.where(peak > 0, torch.tensor(127.0) / peak, torch.zeros(()))
    xq = torch.round(xf * inverse).clamp(-128, 127)  # float32 product, then nearest even
    rounded = (xq.double() * (peak / 127.0).double()).reshape(m, k)
    return rounded @ w_deq.double().t()


@pytest.fixture
def int8_kernel(kernel):
    if kernel.function_q8 is None:
        pytest.skip("this CPU has no VNNI: drafts keep bf16 activations")
    return kernel


@pytest.mark.parametrize(("n", "k", "group"), [(48, 64, 32), (40, 576, 64), (100, 256, 128)])
def test_int8_activations_are_the_rounded_rows_times_the_weight(int8_kernel, n, k, group):
    layer, w_deq = _layer(n, k, group, seed=n + k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    x[3, :group] = 0  # an all-zero group: scale 0, adds nothing
    layer.int8_activations = True
    out, ref = layer(x).double(), _int8_rows_reference(x, w_deq, group)
    assert (out - ref).abs().max() <= 2**-8 * ref.abs().max()  # the int8 sums are exact; bf16 output
    exact = x.double() @ w_deq.double().t()
    assert ((out - exact).norm() / exact.norm()).item() < 0.02  # rounding x to int8 costs ~0.5% here
    alone = torch.cat([layer(x[i : i + 1]) for i in range(6)])
    assert torch.equal(layer(x), alone)


def test_only_a_draft_rounds_its_activations(int8_kernel, tiny_llama_dir, tiny_draft_dir, monkeypatch):
    from tiny_models import make_llm

    from specserve.engine.quantization import round_draft_activations

    llm = make_llm(
        tiny_llama_dir,
        quantization_encoding="int4",
        speculative_method="draft_model",
        draft_model_path=str(tiny_draft_dir),
        draft_quantization_encoding="int4",
    )

    def int4_layers(model):
        return [m for m in model.modules() if isinstance(m, Int4TiledLinear)]

    target_layers, draft_layers = int4_layers(llm.engine.model), int4_layers(llm.engine.proposer.model)
    assert target_layers and draft_layers
    assert all(m.int8_activations for m in draft_layers)
    assert not any(m.int8_activations for m in target_layers)
    assert "int8 activations" in repr(draft_layers[0])
    monkeypatch.setenv("SPECSERVE_DRAFT_INT8_ACTIVATIONS", "0")
    assert round_draft_activations(llm.engine.model) == 0
