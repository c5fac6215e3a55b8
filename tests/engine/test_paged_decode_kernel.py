"""The C paged-decode kernel (engine/paged_decode.c) against the torch matmul path and a float64
reference: decodes and verification windows, GQA shapes, a first visible position, both builds (the
AVX512-BF16 vector path where this CPU has it, and the plain loops), and its build errors."""

from __future__ import annotations

import logging

import pytest
import torch

from specserve.engine import attention
from specserve.engine.attention import AttentionMetadata, cpu_paged_attention, kernel_paged_attention
from specserve.engine.paged_decode_kernel import (
    KernelBuildError,
    PagedDecodeKernel,
    build_paged_decode,
    default_paged_decode,
)

BLOCK = 16


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> PagedDecodeKernel:
    return build_paged_decode(tmp_path_factory.mktemp("kernel"))


@pytest.fixture(scope="module")
def generic_kernel(tmp_path_factory) -> PagedDecodeKernel:
    built = build_paged_decode(tmp_path_factory.mktemp("generic"), defines=("SPECSERVE_GENERIC",))
    assert not built.vector_bf16 and not built.vector_heads
    return built


def _step(q_lens, c_lens, heads, kv_heads, dim, dtype, seed=0, context_starts=None):
    """A step's q, k, v, caches and metadata; every sequence's blocks scattered over the cache, slot 0
    reserved as the zero pad slot."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // BLOCK) for c in c_lens]
    order = (torch.randperm(sum(blocks), generator=g) + 1).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    slots = (sum(blocks) + 1) * BLOCK
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    k_cache[:BLOCK] = 0
    v_cache[:BLOCK] = 0
    tokens = sum(q_lens)
    q = (2 * torch.randn(tokens, heads, dim, generator=g)).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(q_lens, c_lens, tables, BLOCK, context_starts=context_starts)
    return q, k, v, k_cache, v_cache, meta


def _attend(backend, step, scale):
    q, k, v, k_cache, v_cache, meta = step
    return backend(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)


def _reference(step, scale):  # float64 matmul path over the same (rounded) inputs
    return _attend(cpu_paged_attention, tuple(t.double() if torch.is_tensor(t) else t for t in step), scale)


SHAPES = [  # q_lens, c_lens, heads, kv_heads, dim
    ([1], [1], 9, 3, 64),  # a first decode: one key
    ([1], [300], 9, 3, 64),
    ([1, 1, 1, 1, 1], [17, 260, 3, 95, 511], 9, 3, 64),  # SmolLM2's heads
    (
        [1] * 9,
        [40 + 37 * i for i in range(9)],
        12,
        2,
        128,
    ),  # Qwen2.5-1.5B's heads, more sequences than threads
    ([5, 5, 5], [120, 33, 64], 12, 2, 128),  # windows
    ([9, 16, 9], [200, 16, 77], 4, 4, 64),  # MHA windows, one as long as its context
    ([3, 2, 3], [50, 70, 20], 8, 1, 32),  # MQA, windows of different lengths in one group
]  # one attention group each (mixed with prefills: tests/engine/test_decoder_parity.py)


@pytest.mark.parametrize("q_lens, c_lens, heads, kv_heads, dim", SHAPES)
def test_float32_rows_equal_the_matmul_path(kernel, q_lens, c_lens, heads, kv_heads, dim):
    step = _step(q_lens, c_lens, heads, kv_heads, dim, torch.float32)
    ours = _attend(kernel_paged_attention(kernel), step, dim**-0.5)
    torch.testing.assert_close(ours, _attend(cpu_paged_attention, step, dim**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lens, c_lens, heads, kv_heads, dim", SHAPES)
@pytest.mark.parametrize("build", ["kernel", "generic_kernel"])
def test_bf16_rows_are_as_close_to_float64_as_the_matmul_paths(
    request, build, q_lens, c_lens, heads, kv_heads, dim
):
    """The vector path (where this CPU has AVX512-BF16) and the plain loops: within bf16 rounding of the
    float64 answer, and on average no further from it than the matmul path (which rounds scores to
    bf16; the kernel keeps them in float32)."""
    built: PagedDecodeKernel = request.getfixturevalue(build)
    step = _step(q_lens, c_lens, heads, kv_heads, dim, torch.bfloat16, seed=1)
    scale = dim**-0.5
    ref = _reference(step, scale)
    # The caches hold the step's own K/V only once a backend wrote them: write, then call the build.
    q, k, v, k_cache, v_cache, meta = step
    assert not meta.groups
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    attention._write_new_kv(k, v, k_cache, v_cache, meta)
    ours = built(q, k_cache, v_cache, meta.seq_info, meta.context_slots, scale).double()
    theirs = _attend(cpu_paged_attention, step, scale).double()
    ours_err, theirs_err = (ours - ref).abs(), (theirs - ref).abs()
    assert ours_err.max() < 0.02
    assert ours_err.mean() <= theirs_err.mean()


def test_a_first_visible_position_hides_the_keys_before_it(kernel):
    """A draft head's queries see only positions from its start (`context_starts`)."""
    step = _step([1, 3], [90, 60], 8, 2, 64, torch.float32, context_starts=[40, 7])
    ours = _attend(kernel_paged_attention(kernel), step, 0.125)
    torch.testing.assert_close(ours, _attend(cpu_paged_attention, step, 0.125), rtol=1e-5, atol=1e-5)
    moved = _step([1, 3], [90, 60], 8, 2, 64, torch.float32, context_starts=[0, 0])
    assert not torch.allclose(ours, _attend(kernel_paged_attention(kernel), moved, 0.125))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])  # bf16 scores: keys as lanes; row by row (MHA)
def test_a_rows_output_does_not_depend_on_the_rest_of_the_batch(kernel, dtype, heads, kv_heads):
    """Each row reads its own context in the same order whatever else the step holds: a sequence's
    decode alone, among seven others, and the same position as a window's last row are bitwise equal."""
    q_lens, c_lens = [1] * 8, [333, 20, 515, 64, 128, 1, 250, 400]
    q, k, v, k_cache, v_cache, meta = _step(q_lens, c_lens, heads, kv_heads, 64, dtype, seed=4)
    backend = kernel_paged_attention(kernel)
    together = backend(q, k, v, k_cache, v_cache, meta, 0.125)  # writes every sequence's new K/V
    for i in (0, 2, 7):
        alone = AttentionMetadata.build([1], [c_lens[i]], [_table(meta, i, c_lens[i])], BLOCK)
        row = backend(q[i : i + 1], k[i : i + 1], v[i : i + 1], k_cache, v_cache, alone, 0.125)
        assert torch.equal(row, together[i : i + 1])
    # Sequence 0 as a 4-token window ending at the same position: its cache already holds the 3 before.
    window = AttentionMetadata.build([4], [c_lens[0]], [_table(meta, 0, c_lens[0])], BLOCK)
    rows = torch.cat([q[:1]] * 4)  # only the last row is compared
    out = backend(
        rows, k_cache[window.slot_mapping], v_cache[window.slot_mapping], k_cache, v_cache, window, 0.125
    )
    assert torch.equal(out[3:], together[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_lens", [[1, 5, 1, 1, 9, 3], [1, 1, 1, 3, 5, 9]])  # interleaved, group after group
def test_decodes_and_windows_in_one_call_equal_them_group_by_group(kernel, monkeypatch, dtype, q_lens):
    """The kernel takes a step's decodes and windows in one call, in the batch's order: the same rows,
    bitwise, as attending each group on its own (which the padded paths need)."""
    step = _step(q_lens, [40, 300, 7, 128, 61, 90], 9, 3, 64, dtype, seed=8)
    meta = step[5]
    assert len(meta.groups) == 3 and (meta.group_order is None) == (q_lens == sorted(q_lens))
    merged = meta.merged_short_queries(attention.SMALL_QUERY_ROWS)
    assert merged is not None and merged.seq_info is not None
    # Sequences listed group by group, each pointing at its rows in the batch's own order.
    assert sorted(merged.seq_info[:, 0].tolist()) == [sum(q_lens[:i]) for i in range(len(q_lens))]
    backend = kernel_paged_attention(kernel)
    together = _attend(backend, step, 0.125)
    monkeypatch.setattr(AttentionMetadata, "merged_short_queries", lambda self, rows: None)
    assert torch.equal(_attend(backend, step, 0.125), together)


def test_a_step_with_a_prefill_chunk_is_not_merged():
    meta = _step([1, 40, 3], [30, 40, 50], 4, 2, 64, torch.float32)[5]
    assert len(meta.groups) == 3 and meta.merged_short_queries(16) is None
    assert _step([1, 1], [30, 40], 4, 2, 64, torch.float32)[5].merged_short_queries(16) is None  # one group


def _table(meta: AttentionMetadata, i: int, c_len: int) -> list[int]:
    slots = meta.context_slots[i, :c_len]
    return (slots[::BLOCK] // BLOCK).tolist()


def test_a_nan_in_one_sequences_cache_stays_in_that_sequence(kernel):
    """Each sequence reads only its own slots: a NaN key of one request cannot reach another's rows."""
    q, k, v, k_cache, v_cache, meta = _step([1, 1, 1], [100, 200, 50], 9, 3, 64, torch.bfloat16, seed=5)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    attention._write_new_kv(k, v, k_cache, v_cache, meta)
    k_cache[meta.context_slots[1, 10]] = float("nan")
    out = kernel(q, k_cache, v_cache, meta.seq_info, meta.context_slots, 0.125).view(3, -1)
    assert out[1].isnan().all() and not out[0].isnan().any() and not out[2].isnan().any()


def test_the_backend_leaves_what_the_kernel_does_not_take_to_the_torch_paths(kernel):
    """Prefill chunks take blocked SDPA; float16 and (without the vector path) odd head sizes the
    matmuls; the kernel takes float32 and, with AVX512-BF16, bf16 heads that are multiples of 32."""
    assert kernel.supports(torch.float32, torch.float32, 8)
    assert not kernel.supports(torch.float16, torch.float16, 64)
    assert not kernel.supports(torch.bfloat16, torch.float32, 64)
    assert not kernel.supports(torch.bfloat16, torch.bfloat16, 48)
    assert kernel.supports(torch.bfloat16, torch.bfloat16, 64) == kernel.vector_bf16
    # The library says which heads its vector path takes: multiples of 32 up to 256, where compiled in.
    assert kernel.vector_heads in (frozenset(), frozenset(range(32, 257, 32)))
    assert not kernel.supports(torch.bfloat16, torch.bfloat16, 288)
    step = _step([40, 33], [40, 90], 4, 2, 64, torch.float32, seed=6)  # a prompt and a chunk: SDPA
    torch.testing.assert_close(
        _attend(kernel_paged_attention(kernel), step, 0.125), _attend(cpu_paged_attention, step, 0.125)
    )
    step = _step([1, 2], [40, 90], 4, 2, 48, torch.bfloat16, seed=6)  # not taken: the matmul path itself
    assert torch.equal(
        _attend(kernel_paged_attention(kernel), step, 0.125), _attend(cpu_paged_attention, step, 0.125)
    )


def test_a_build_is_reused_and_build_errors_say_what_failed(tmp_path, kernel):
    again = build_paged_decode(kernel.path.parent.parent)
    assert again.path == kernel.path
    with pytest.raises(KernelBuildError, match="no C compiler 'no-such-cc' on PATH"):
        build_paged_decode(tmp_path, compiler="no-such-cc")
    with pytest.raises(KernelBuildError, match="failed"):
        build_paged_decode(tmp_path, compiler="false")  # found, exits 1 without a word
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left to load


def test_without_a_compiler_attention_falls_back_to_matmuls_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    default_paged_decode.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="specserve.engine"):
            assert attention.select_attention_backend("cpu") == (
                "cpu_sdpa_prefill_matmul_decode",
                cpu_paged_attention,
            )
            attention.select_attention_backend("cpu")
        assert [r.getMessage() for r in caplog.records] == [
            "paged-decode kernel unavailable, decodes use torch matmuls: no C compiler 'no-such-cc' on PATH"
        ]
        monkeypatch.setenv("CC", "gcc")
        monkeypatch.setenv("SPECSERVE_PAGED_DECODE", "0")
        default_paged_decode.cache_clear()
        assert attention.select_attention_backend("cpu")[0] == "cpu_sdpa_prefill_matmul_decode"
    finally:
        default_paged_decode.cache_clear()
