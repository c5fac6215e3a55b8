"""The C row operations of bf16 layers (engine/row_ops.c): RMSNorm with the residual add, rotary
embedding and SiLU(gate) * up against torch's ops, a row's independence of its batch, the routing
(bf16 CPU only) and where the loader installs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.engine import row_ops_kernel
from specserve.engine.models.factory import load_decoder
from specserve.engine.models.layers import GatedMLP, RMSNorm, use_row_ops
from specserve.engine.models.rope import RotaryEmbedding
from specserve.engine.row_ops_kernel import build_row_ops_kernel
from specserve.engine.runner import SequenceInput, forward_sequences
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return build_row_ops_kernel(tmp_path_factory.mktemp("row-ops"))


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (same signs assumed): their bit patterns' distance."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _norm(dim: int, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(torch.bfloat16)
    norm.weight.data = _bf16(dim, seed=seed).abs() + 0.5
    return norm


# dims: a whole number of 16 lanes, a ragged tail, fewer than 16; scales: small and large activations
@pytest.mark.parametrize("dim", [896, 1000, 9])
@pytest.mark.parametrize("scale", [0.01, 30.0])
def test_add_rms_norm_is_torchs_but_for_the_sum_order(kernel, dim, scale):
    x, delta, norm = _bf16(64, dim, seed=1, scale=scale), _bf16(64, dim, seed=2, scale=scale), _norm(dim, 3)
    total, normed = kernel.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)  # one float32 add, one rounding: torch's exactly
    theirs = norm(x + delta)  # torch's ops (no kernel installed)
    apart = _bf16_steps_apart(normed, theirs)
    assert apart.max() <= 1 and (apart == 0).float().mean() >= 0.99
    # and the norm alone, as the layer's first norm calls it
    assert torch.equal(kernel.rms_norm(x + delta, norm.weight, norm.eps), normed)


def test_rms_norm_reads_strided_rows_in_place(kernel):
    wide, norm = _bf16(5, 300, seed=4), _norm(200, 5)
    rows = wide[:, 50:250]  # [5, 200], row stride 300
    assert torch.equal(
        kernel.rms_norm(rows, norm.weight, norm.eps),
        kernel.rms_norm(rows.contiguous(), norm.weight, norm.eps),
    )


def test_rms_norm_refuses_a_weight_of_another_size(kernel):
    with pytest.raises(ValueError, match="weight of 8 for rows of 9"):
        kernel.rms_norm(_bf16(2, 9, seed=1), _bf16(8, seed=2), 1e-6)


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}]
)
def test_rope_is_torchs_bit_for_bit(kernel, scaling):
    rope = RotaryEmbedding(64, 4096, 1e6, scaling)
    # q and k as the attention layer passes them: views of one qkv row (row stride 14*64 + 2*2*64)
    qkv = _bf16(9, (14 + 4) * 64, seed=6, scale=3.0)
    q = qkv[:, : 14 * 64].view(9, 14, 64)
    k = qkv[:, 14 * 64 : 16 * 64].view(9, 2, 64)
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 1000, 4000, 4095])
    ours = kernel.rope(q, k, positions, rope.cos, rope.sin)
    theirs = rope(positions, q, k)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_rope_refuses_a_position_beyond_the_table(kernel):
    rope = RotaryEmbedding(16, 32, 1e4, None)
    q, k = _bf16(2, 2, 16, seed=1), _bf16(2, 1, 16, seed=2)
    with pytest.raises(IndexError, match="outside the table's 32 rows"):
        kernel.rope(q, k, torch.tensor([3, 32]), rope.cos, rope.sin)


@pytest.mark.parametrize("scale", [0.3, 4.0, 40.0])
def test_silu_mul_is_torchs_but_for_exp(kernel, scale):
    gate_up = _bf16(16, 2 * 4864, seed=7, scale=scale)
    gate, up = gate_up.split(4864, dim=-1)
    ours, theirs = kernel.silu_mul(gate_up, 4864), F.silu(gate) * up
    apart = _bf16_steps_apart(ours, theirs)
    assert apart.max() <= 1 and (apart == 0).float().mean() >= 0.99
    # against float64, rounded as torch rounds: silu to bf16, then the product; where e^-gate
    # overflows float32 (gate < -88.7) torch's silu is 0 too, and float64's a tiny number
    exact_silu = (gate.double() * torch.sigmoid(gate.double())).to(torch.bfloat16)
    exact = (exact_silu.double() * up.double()).to(torch.bfloat16)
    finite = gate > -80
    assert finite.float().mean() > 0.9 and _bf16_steps_apart(ours[finite], exact[finite]).max() <= 1


def test_silu_mul_meets_infinities_and_nans_as_torch_does(kernel):
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 100.0, -100.0, -88.0, 89.0, 0.0])
    gate_up = torch.cat([special, torch.ones(8)]).to(torch.bfloat16).view(1, 16)
    ours, theirs = kernel.silu_mul(gate_up, 8), F.silu(gate_up[:, :8]) * gate_up[:, 8:]
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


def test_silu_mul_refuses_rows_of_another_width(kernel):
    with pytest.raises(ValueError, match="rows of 10 for an intermediate size of 4"):
        kernel.silu_mul(_bf16(2, 10, seed=1), 4)


def test_a_row_does_not_depend_on_its_batch(kernel):
    """Many rows take every thread (OpenMP above 65,536 values); a row's result is the same alone."""
    dim, inter, norm = 4096, 4096, _norm(4096, 8)
    x, delta, gate_up = _bf16(33, dim, seed=9), _bf16(33, dim, seed=10), _bf16(33, 2 * inter, seed=11)
    rope = RotaryEmbedding(128, 64, 1e4, None)
    q, k, positions = _bf16(33, 32, 128, seed=12), _bf16(33, 8, 128, seed=13), torch.arange(33)
    batch = (
        kernel.add_rms_norm(x, delta, norm.weight, norm.eps)[1],
        kernel.silu_mul(gate_up, inter),
        *kernel.rope(q, k, positions, rope.cos, rope.sin),
    )
    for i in (0, 17, 32):
        row = slice(i, i + 1)
        alone = (
            kernel.add_rms_norm(x[row], delta[row], norm.weight, norm.eps)[1],
            kernel.silu_mul(gate_up[row], inter),
            *kernel.rope(q[row], k[row], positions[row], rope.cos, rope.sin),
        )
        assert all(torch.equal(b[row], a) for b, a in zip(batch, alone, strict=True))


def test_a_nan_row_spoils_only_itself(kernel):
    x, norm = _bf16(3, 64, seed=14), _norm(64, 15)
    x[1, 7] = float("nan")
    normed = kernel.rms_norm(x, norm.weight, norm.eps)
    assert normed[1].isnan().all() and not normed[[0, 2]].isnan().any()


def test_layers_route_only_bf16_cpu_rows_to_the_kernel(kernel):
    norm32 = RMSNorm(16, 1e-6)
    norm32.row_ops = kernel
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm32(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    # A rope whose tables were cast with the whole model (bf16) keeps torch's ops, which gather them.
    rope = RotaryEmbedding(16, 32, 1e4, None).to(torch.bfloat16)
    q, k = _bf16(2, 2, 16, seed=1), _bf16(2, 1, 16, seed=2)
    expected = rope(torch.tensor([1, 2]), q, k)
    rope.row_ops = kernel
    got = rope(torch.tensor([1, 2]), q, k)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _last_hidden(model, prompt: list[int]) -> torch.Tensor:  # [1, hidden]
    cache = model.allocate_kv_cache(64, torch.bfloat16, "cpu")
    return forward_sequences(model, cache, [SequenceInput(prompt, 0, [0, 1, 2, 3], 1)], 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_bf16_model_with_row_ops_answers_as_with_torchs(kernel, tmp_path, arch):
    build_tiny_model(tmp_path, arch, seed=1, with_tokenizer=False, norm_noise=0.1)
    model = load_decoder(tmp_path, torch.bfloat16)
    prompt = list(range(3, 40))
    use_row_ops(model, kernel)
    ours = _last_hidden(model, prompt)
    use_row_ops(model, None)  # torch's ops
    theirs = _last_hidden(model, prompt)
    # A few bf16 steps apart at most, through two layers (the norms' and exp's last bits).
    torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)
    assert (ours == theirs).float().mean() >= 0.9


def test_the_loader_installs_them_for_bf16_cpu_models_only(kernel, tiny_llama_dir):
    def kernels(model) -> set:
        return {
            m.row_ops is not None
            for m in model.modules()
            if isinstance(m, RMSNorm | RotaryEmbedding | GatedMLP)
        }

    assert kernels(load_decoder(tiny_llama_dir, torch.bfloat16)) == {True}
    assert kernels(load_decoder(tiny_llama_dir, torch.bfloat16, batch_invariant=True)) == {True}
    assert kernels(load_decoder(tiny_llama_dir, torch.float32)) == {False}


def test_switched_off_bf16_models_keep_torchs_ops(switch_kernel_off, tiny_llama_dir):
    switch_kernel_off("SPECSERVE_ROW_OPS_KERNEL", row_ops_kernel.default_row_ops_kernel)
    assert row_ops_kernel.default_row_ops_kernel() is None
    model = load_decoder(tiny_llama_dir, torch.bfloat16)
    assert all(m.row_ops is None for m in model.modules() if isinstance(m, RMSNorm | GatedMLP))


def test_gemma_keeps_its_own_norm_and_activation(kernel, tmp_path):
    """Gemma's norm scales by 1 + w and its MLP is GeGLU: neither is ours, and the rope is ours bit for
    bit, so its answers do not change."""
    build_tiny_model(tmp_path, "gemma", seed=2, with_tokenizer=False, norm_noise=0.1)
    model = load_decoder(tmp_path, torch.bfloat16)
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    assert not any(m.fused_silu for m in model.modules() if isinstance(m, GatedMLP))
    use_row_ops(model, kernel)
    ours = _last_hidden(model, list(range(3, 40)))
    use_row_ops(model, None)
    assert torch.equal(ours, _last_hidden(model, list(range(3, 40))))
