"""Batch-invariant numerics (issue 18, item 8): a position's result does not depend on what else
shares the forward, so greedy speculation equals plain decoding in bf16 and output does not change
with concurrency."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llm, mixed_prompts

from specserve.engine import SamplingParams, attention
from specserve.engine.attention import (
    INVARIANT_QUERY_TILE,
    SMALL_QUERY_ROWS,
    AttentionMetadata,
    batch_invariant_paged_attention,
    cpu_paged_attention,
    paged_attention,
)
from specserve.engine.models.row_invariant_linear import RowInvariantLinear, make_linears_row_invariant

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def test_bf16_matmul_rows_do_not_depend_on_the_batch():
    """The premise the attention relies on (oneDNN's bf16 GEMM on this CPU): a row's product is the
    same for any number of rows and any zero-padded reduction length. If a new torch or CPU breaks
    this, this test says so before the engine tests do."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 600, 64, generator=g).bfloat16()
    b = torch.randn(2, 3, 64, 640, generator=g).bfloat16()
    ref = torch.matmul(a[:1, :, :1], b[:1, :, :, :320])  # [1, 3, 1, 320]
    for rows in (1, 3, 17, 300, 600):
        for cols in (320, 384, 640):
            assert torch.equal(torch.matmul(a[:, :, :rows], b[..., :cols])[:1, :, :1, :320], ref)
    p = torch.rand(1, 3, 5, 640, generator=g).bfloat16()
    p[..., 300:] = 0
    v = torch.randn(1, 3, 640, 64, generator=g).bfloat16()
    ref = torch.matmul(p[..., :320], v[:, :, :320])
    assert torch.equal(torch.matmul(p[:, :, :2, :640], v)[:, :, :2], ref[:, :, :2])


def test_a_lone_row_of_a_row_invariant_linear_is_the_row_of_a_batch():
    """The premise above fails for one row at a long reduction on some CPUs (AMD EPYC, AVX-512 BF16:
    27 of 300 rows of a 1536 -> 576 bf16 linear differed alone from in a batch of 300, none from two
    rows on); the batch-invariant model's linears (RowInvariantLinear) compute a lone row as the
    first of two, so each row equals its row in any batch. Swapped in place, parameters shared."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(1536, 576, bias=False).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(576, 1536, generator=g) * 0.05)
    x = (torch.randn(300, 1536, generator=g) * torch.rand(300, 1, generator=g) * 3).bfloat16()
    holder = torch.nn.Sequential(linear)
    assert make_linears_row_invariant(holder) == 1
    invariant = holder[0]
    assert isinstance(invariant, RowInvariantLinear) and invariant.weight is linear.weight
    with torch.inference_mode():
        batch = invariant(x)
        assert torch.equal(batch, linear(x))  # many rows: the plain GEMM
        for i in range(300):
            assert torch.equal(invariant(x[i : i + 1])[0], batch[i]), i
            assert torch.equal(invariant(x[i]), batch[i]), i  # a 1-D row too


def _attention(backend, seqs: list[tuple[int, int, int]], qkv: dict[int, tuple], dtype=torch.bfloat16):
    """Run `backend` over sequences (id, context length, query length); their fed tokens' q/k/v come
    from qkv[id] (the whole sequence), earlier positions are written to the cache first."""
    num_slots = 3 * 48 * BLOCK  # 48 blocks (768 tokens) per sequence
    k_cache = torch.zeros(num_slots + 1, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = {sid: list(range(48 * i, 48 * i + 48)) for i, sid in enumerate(sorted(qkv))}
    qs, ks, vs = [], [], []
    for sid, ctx, n_q in seqs:
        q, k, v = qkv[sid]
        cached = torch.arange(ctx - n_q)  # the context already in the cache
        slots = torch.tensor(tables[sid])[cached // BLOCK] * BLOCK + cached % BLOCK
        k_cache[slots], v_cache[slots] = k[: ctx - n_q], v[: ctx - n_q]
        qs.append(q[ctx - n_q : ctx])
        ks.append(k[ctx - n_q : ctx])
        vs.append(v[ctx - n_q : ctx])
    meta = AttentionMetadata.build(
        [n for _, _, n in seqs],
        [c for _, c, _ in seqs],
        [tables[s] for s, _, _ in seqs],
        BLOCK,
        pad_slot=num_slots,
    )
    out = backend(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, DIM**-0.5)
    rows, start = {}, 0
    for sid, _ctx, n_q in seqs:
        rows[sid] = out[start : start + n_q]  # [n_q, H * D]: positions ctx - n_q .. ctx - 1
        start += n_q
    return rows


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(1)
    return {
        sid: (
            torch.randn(length, HEADS, DIM, generator=g).bfloat16(),
            torch.randn(length, KV_HEADS, DIM, generator=g).bfloat16(),
            torch.randn(length, KV_HEADS, DIM, generator=g).bfloat16(),
        )
        for sid, length in ((0, 600), (1, 700), (2, 90))
    }


# Each case: the batch, and which (sequence, position) rows to compare against decoding them alone.
CASES = {
    "verification window": [(0, 301, 6)],
    "decode next to a longer context": [(0, 301, 1), (1, 690, 1), (2, 40, 1)],
    "windows of different lengths": [(2, 60, 3), (0, 301, 9), (1, 500, 1)],
    "prefill beside another prefill": [(1, 450, 450), (0, 301, 301)],
    "prefill chunk beside decodes": [(0, 301, 77), (2, 89, 1), (1, 650, 4)],
}


def _sample_positions(first: int, end: int) -> list[int]:
    """Every position of a short query span; both ends and every 23rd of a long one (a prefill)."""
    if end - first <= 12:
        return list(range(first, end))
    return sorted({first, first + 1, end - 2, end - 1, *range(first, end, 23)})


@pytest.mark.parametrize("case", list(CASES))
def test_invariant_attention_rows_equal_decoding_alone(qkv, case):
    batch = CASES[case]
    rows = _attention(batch_invariant_paged_attention, batch, qkv)
    for sid, ctx, n_q in batch:
        for pos in _sample_positions(ctx - n_q, ctx):
            alone = _attention(batch_invariant_paged_attention, [(sid, pos + 1, 1)], qkv)[sid][0]
            assert torch.equal(rows[sid][pos - (ctx - n_q)], alone), (case, sid, pos)


def test_sdpa_is_not_batch_invariant_here(qkv):
    """Why the invariant path exists: the same comparison through torch SDPA finds differences (if a
    future torch makes SDPA invariant, the default could switch back to it)."""
    differing = 0
    for batch in CASES.values():
        rows = _attention(paged_attention, batch, qkv)
        for sid, ctx, n_q in batch:
            for pos in range(ctx - n_q, ctx, 7):
                alone = _attention(paged_attention, [(sid, pos + 1, 1)], qkv)[sid][0]
                differing += not torch.equal(rows[sid][pos - (ctx - n_q)], alone)
    assert differing > 0


def test_invariant_attention_matches_sdpa_closely(qkv):
    """Same maths as SDPA at transformers-eager precision (bf16 scores and weights)."""
    batch = CASES["prefill chunk beside decodes"]
    ours = _attention(batch_invariant_paged_attention, batch, qkv)
    ref = _attention(paged_attention, batch, qkv)
    for sid in ours:
        assert (ours[sid].float() - ref[sid].float()).abs().max() < 0.05


def test_long_prefill_is_tiled_without_changing_rows(qkv):
    assert INVARIANT_QUERY_TILE < 450  # the prefill below spans two query tiles
    rows = _attention(batch_invariant_paged_attention, [(1, 450, 450)], qkv)[1]
    for pos in (0, INVARIANT_QUERY_TILE - 1, INVARIANT_QUERY_TILE, 449):
        alone = _attention(batch_invariant_paged_attention, [(1, pos + 1, 1)], qkv)[1][0]
        assert torch.equal(rows[pos], alone), pos


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _decode(llm, prompts, params, concurrency):
    out = []
    for i in range(0, len(prompts), concurrency):
        out += [
            o.token_ids for o in llm.generate(prompts[i : i + concurrency], params, use_chat_template=False)
        ]
    return out


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_bf16_greedy_speculation_and_concurrency_are_token_identical(tiny_llama_dir, tiny_draft_dir, method):
    prompts = mixed_prompts(6, seed=4)
    kwargs = {
        "quantization_encoding": "bfloat16",
        "speculative_method": method,
        "num_speculative_tokens": 4,
        "batch_invariant": True,
    }
    if method == "draft_model":
        kwargs["draft_model_path"] = str(tiny_draft_dir)
    llm = make_llm(tiny_llama_dir, **kwargs)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculative_enabled=False)
    reference = _decode(llm, prompts, plain, 1)
    assert _decode(llm, prompts, plain, 6) == reference  # plain, all at once
    assert _decode(llm, prompts, GREEDY, 1) == reference  # speculative, alone
    assert _decode(llm, prompts, GREEDY, 6) == reference  # speculative, all at once
    assert llm.engine.stats.spec.num_accepted_tokens > 0


@pytest.mark.slow  # ~1 min of the default suite's 10; the tiny bf16 model covers the mechanism there
def test_smollm2_bf16_greedy_speculation_and_concurrency_are_token_identical():
    """The real SmolLM2-135M (embedded default) in bf16 with n-gram speculation."""
    from specserve.engine import LLM

    llm = LLM(
        quantization_encoding="bfloat16",
        speculative_method="ngram",
        max_kv_cache_tokens=8192,
        max_length=1024,
        batch_invariant=True,
    )
    prompts = [
        llm.encode_prompt(p)
        for p in (
            "Write a Python function that merges two sorted lists.",
            "List ten animals that live in the ocean and describe each.",
            "Write a bash script that counts lines in all .py files, then explain it.",
        )
    ]
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative_enabled=False)
    spec = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = _decode(llm, prompts, plain, 1)
    assert _decode(llm, prompts, plain, 3) == reference
    assert _decode(llm, prompts, spec, 1) == reference
    assert _decode(llm, prompts, spec, 3) == reference


@pytest.mark.parametrize("case", list(CASES))
def test_default_cpu_backend_is_the_same_attention_as_sdpa(qkv, case):
    """The default CPU backend: prefill chunks (more than SMALL_QUERY_ROWS query rows) go to SDPA in
    blocks of query rows, each against the keys it may see (rounded as SDPA's key blocks fall: to
    bf16 rounding of the output); decodes and windows go through matmuls, the same attention at
    transformers-eager precision (bf16 scores). In float32 both are the same to rounding."""
    batch = CASES[case]
    ours, ref = _attention(cpu_paged_attention, batch, qkv), _attention(paged_attention, batch, qkv)
    as_float = {sid: tuple(t.float() for t in tensors) for sid, tensors in qkv.items()}
    ours32 = _attention(cpu_paged_attention, batch, as_float, torch.float32)
    ref32 = _attention(paged_attention, batch, as_float, torch.float32)
    for sid, _ctx, n_q in batch:
        bf16_tolerance = 0.01 if n_q > SMALL_QUERY_ROWS else 0.05
        assert (ours[sid].float() - ref[sid].float()).abs().max() < bf16_tolerance, sid
        assert (ours32[sid] - ref32[sid]).abs().max() < 1e-5, sid


def test_prefill_query_blocks_see_only_the_keys_their_rows_may_attend():
    """A fresh prompt's blocks of query rows end their keys at their last row (the diagonal); a chunk
    after a cached prefix at its last row's position; sequences padded together at the furthest of
    them. These are the keys `_blocked_sdpa_attention` gives each block."""
    fresh = AttentionMetadata.build([150], [150], [list(range(10))], BLOCK)
    assert fresh.query_blocks(64) == [(0, 64, 64), (64, 128, 128), (128, 150, 150)]
    chunk = AttentionMetadata.build([80], [180], [list(range(12))], BLOCK)
    assert chunk.query_blocks(64) == [(0, 64, 164), (64, 80, 180)]
    padded = AttentionMetadata.build([40, 70], [40, 100], [list(range(3)), list(range(7))], BLOCK)
    assert padded.query_blocks(32) == [(0, 32, 62), (32, 64, 94), (64, 70, 100)]
    assert padded.query_blocks(64) == [(0, 64, 94), (64, 70, 100)]  # one cache per block size


def test_blocked_prefill_equals_one_sdpa_call_in_float32(qkv, monkeypatch):
    """Blocks of a few query rows (many blocks, most keys cut off) give a long prefill's rows, next to
    a chunk after a cached prefix, what one SDPA call over the whole padded context gives."""
    as_float = {sid: tuple(t.float() for t in tensors) for sid, tensors in qkv.items()}
    batch = [(1, 450, 450), (0, 301, 240)]
    whole = _attention(paged_attention, batch, as_float, torch.float32)
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", 7)
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        seen.append((query.shape[-2], key.shape[-2]))  # (query rows, keys) of one call
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    blocked = _attention(cpu_paged_attention, batch, as_float, torch.float32)
    for sid, _ctx, _n_q in batch:
        assert (blocked[sid] - whole[sid]).abs().max() < 1e-5, sid
    # 65 blocks of 7 rows (the last 2) over the 450 padded rows; the first sees the furthest row's
    # keys: the chunk's row 6 (position 67).
    assert len(seen) == 65 and seen[0] == (7, 68) and seen[-1] == (2, 450), seen[:2]


def test_default_cpu_backend_tiles_many_sequences_without_changing_rows(qkv, monkeypatch):
    """Contexts are gathered and scored a few sequences at a time (SCORE_TILE_ELEMENTS,
    GATHER_TILE_ELEMENTS); a tile of one sequence gives every row exactly what one tile of all three
    does."""
    batch = CASES["decode next to a longer context"]
    whole = _attention(cpu_paged_attention, batch, qkv)
    monkeypatch.setattr(attention, "SCORE_TILE_ELEMENTS", 1)
    tiled = _attention(cpu_paged_attention, batch, qkv)
    for sid, _ctx, _n_q in batch:
        assert torch.equal(tiled[sid], whole[sid]), sid
