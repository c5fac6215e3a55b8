"""The few-row bf16 kernel (engine/bf16_matmul.c) and its layer (SmallBatchLinear): answers against
float64 and torch's kernel, a row's independence of its batch, the routing by row count, and where the
loader installs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine import bf16_kernel
from specserve.engine.bf16_kernel import build_bf16_kernel
from specserve.engine.c_library import KernelBuildError
from specserve.engine.models import small_batch_linear
from specserve.engine.models.factory import load_decoder
from specserve.engine.models.row_invariant_linear import RowInvariantLinear
from specserve.engine.models.small_batch_linear import SmallBatchLinear, use_small_batch_kernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    try:
        return build_bf16_kernel(tmp_path_factory.mktemp("bf16"))
    except KernelBuildError as e:  # a machine without AVX512-BF16: the fallback tests below still run
        pytest.skip(str(e))


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# K: whole 32-input chunks, a ragged tail, fewer than one chunk; N: whole and ragged channel blocks.
@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 576), (7, 100), (13, 20), (100, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_matches_float64_as_closely_as_torchs_kernel(kernel, n, k, rows):
    w, x = _bf16(n, k, seed=n + k), _bf16(rows, k, seed=rows)
    exact = x.double() @ w.double().t()  # [M, N]
    ours, theirs = kernel(x, w, None), F.linear(x, w)
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    # Float32 sums of exact products, rounded once to bf16: within half a bf16 step of the exact
    # answer, plus what float32 summation can lose against the terms' magnitudes.
    scale = x.double().abs() @ w.double().abs().t()
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + scale * 2**-20).all()
    assert (ours.double() - exact).abs().mean() <= (theirs.double() - exact).abs().mean() * 1.05 + 1e-9


def test_bias_is_added_before_the_rounding(kernel):
    w, x, b = _bf16(40, 128, seed=1), _bf16(3, 128, seed=2), _bf16(40, seed=3)
    exact = x.double() @ w.double().t() + b.double()
    ours = kernel(x, w, b)
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert not torch.equal(ours, kernel(x, w, None))


@pytest.mark.parametrize(("n", "k"), [(40, 576), (23, 1536), (64, 100)])
def test_a_row_does_not_depend_on_its_batch(kernel, n, k):
    """Within the kernel's range a verification window's rows get the logits of one-token steps."""
    w, x = _bf16(n, k, seed=7), _bf16(33, k, seed=3)
    alone = torch.cat([kernel(x[i : i + 1], w, None) for i in range(33)])
    for rows in (2, 4, 5, 11, 33):
        assert torch.equal(kernel(x[:rows], w, None), alone[:rows]), rows
    assert torch.equal(kernel(x[6:11], w, None)[-1], alone[10])  # a row in another place of its block


def test_strided_rows_are_read_in_place(kernel):
    w, wide = _bf16(24, 64, seed=4), _bf16(5, 96, seed=5)
    x = wide[:, 16:80]  # rows 96 apart, unit stride along K
    assert x.stride() == (96, 1)
    assert torch.equal(kernel(x, w, None), kernel(x.contiguous(), w, None))


def test_a_nan_row_spoils_only_itself(kernel):
    w, x = _bf16(64, 128, seed=2), _bf16(5, 128, seed=2)
    x[2, 7] = float("nan")
    out = kernel(x, w, None)
    assert out[2].isnan().all() and not out[[0, 1, 3, 4]].isnan().any()


def _small_batch_layer(kernel, n: int, k: int, bias: bool) -> SmallBatchLinear:
    linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    holder = nn.Sequential(linear)
    assert use_small_batch_kernel(holder, kernel) == 1
    layer = holder[0]
    assert isinstance(layer, SmallBatchLinear) and layer.weight is linear.weight and layer.bias is linear.bias
    return layer


def test_few_rows_take_the_kernel_and_many_take_torchs(kernel):
    layer = _small_batch_layer(kernel, 40, 64, bias=True)
    few = _bf16(2, 3, 64, seed=6)  # leading dimensions: 6 rows
    assert torch.equal(layer(few), kernel(few.reshape(6, 64), layer.weight, layer.bias).reshape(2, 3, 40))
    many = _bf16(small_batch_linear.MAX_KERNEL_ROWS + 1, 64, seed=7)
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
    wide = _bf16(4, 128, seed=8)
    assert torch.equal(layer(wide[:, ::2]), kernel(wide[:, ::2].contiguous(), layer.weight, layer.bias))
    layer.float()  # a layer cast after the swap (and its float32 callers) keeps torch's path
    x32 = torch.randn(3, 64)
    assert torch.equal(layer(x32), F.linear(x32, layer.weight, layer.bias))


def test_only_plain_bf16_linears_are_swapped(kernel):
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(50, 32),
            "head": nn.Linear(32, 50, bias=False),
            "float32": nn.Linear(32, 32),
            "invariant": RowInvariantLinear(32, 32),
        }
    )
    model["embed"].to(torch.bfloat16)
    model["head"].to(torch.bfloat16)
    model["invariant"].to(torch.bfloat16)
    model["head"].weight = model["embed"].weight  # tied
    assert use_small_batch_kernel(model, kernel) == 1
    assert isinstance(model["head"], SmallBatchLinear) and model["head"].weight is model["embed"].weight
    assert type(model["float32"]) is nn.Linear and type(model["invariant"]) is RowInvariantLinear


def test_the_loader_installs_it_for_bf16_cpu_models_only(kernel, tiny_llama_dir):
    def linears(model: nn.Module) -> set[type]:
        return {type(m) for m in model.modules() if isinstance(m, nn.Linear)}

    assert linears(load_decoder(tiny_llama_dir, torch.bfloat16)) == {SmallBatchLinear}
    assert linears(load_decoder(tiny_llama_dir, torch.float32)) == {nn.Linear}
    # Batch-invariant numerics keep one kernel for every row count.
    assert linears(load_decoder(tiny_llama_dir, torch.bfloat16, batch_invariant=True)) == {RowInvariantLinear}


def test_switched_off_bf16_models_keep_torchs_kernel(switch_kernel_off, tiny_llama_dir):
    switch_kernel_off("SPECSERVE_BF16_KERNEL", bf16_kernel.default_bf16_kernel)
    assert bf16_kernel.default_bf16_kernel() is None
    model = load_decoder(tiny_llama_dir, torch.bfloat16)
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


def test_a_build_without_avx512_bf16_is_refused(tmp_path):
    with pytest.raises(KernelBuildError, match="needs AVX512-BF16"):
        build_bf16_kernel(tmp_path, defines=("SPECSERVE_GENERIC",))
