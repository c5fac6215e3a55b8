"""Our decoder's logits match transformers' implementation of the same weights (float32)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from specserve.engine.attention import AttentionMetadata
from specserve.engine.models.factory import load_decoder

BLOCK = 4


def _run(model, seqs: list[tuple[list[int], int]], kv, tables):
    """seqs: (token ids of the whole sequence so far, number of new tokens at the end)."""
    ids, pos, q_lens, c_lens = [], [], [], []
    for tokens, n_new in seqs:
        ids += tokens[-n_new:]
        pos += list(range(len(tokens) - n_new, len(tokens)))
        q_lens.append(n_new)
        c_lens.append(len(tokens))
    meta = AttentionMetadata.build(q_lens, c_lens, tables, BLOCK)
    hidden = model(torch.tensor(ids), torch.tensor(pos), kv, meta)
    return model.compute_logits(hidden)  # [T, vocab]


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma"])
def test_logits_match_transformers(tmp_path, arch):
    # Gemma ties lm_head to the embedding in every released model; test it that way.
    tied = arch in ("qwen2", "gemma")
    ref = build_tiny_model(
        tmp_path, arch, seed=3, with_tokenizer=False, norm_noise=0.1, tie_word_embeddings=tied
    )
    model = load_decoder(tmp_path, torch.float32)
    kv = model.allocate_kv_cache(64 * BLOCK, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 320, (13,), generator=g).tolist()
    b = torch.randint(0, 320, (7,), generator=g).tolist()
    with torch.no_grad():
        ref_a = ref(torch.tensor([a])).logits[0]  # [13, vocab]
        ref_b = ref(torch.tensor([b])).logits[0]
        tables = [list(range(0, 8)), list(range(20, 28))]
        # Prefill of a (first 10 tokens) together with prefill of b (all 7): one ragged forward.
        out = _run(model, [(a[:10], 10), (b, 7)], kv, tables)
        assert (out[:10] - ref_a[:10]).abs().max() < 1e-4
        assert (out[10:] - ref_b).abs().max() < 1e-4
        # Then a 3-token window on a (a verification-shaped step) mixed with one decode-shaped row of b.
        out = _run(model, [(a, 3)], kv, tables[:1])
        assert (out - ref_a[10:]).abs().max() < 1e-4
        b2 = b + [a[0]]
        ref_b2 = ref(torch.tensor([b2])).logits[0, -1]
        a2 = a + [b[0]]
        ref_a2 = ref(torch.tensor([a2])).logits[0, -1]
        out = _run(model, [(b2, 1), (a2, 1)], kv, [tables[1], tables[0]])
        assert (out[0] - ref_b2).abs().max() < 1e-4
        assert (out[1] - ref_a2).abs().max() < 1e-4


def test_attention_backend_selection():
    from specserve.engine.attention import select_attention_backend

    # This machine has gcc: the paged-decode kernel (the fallback: tests/engine/test_paged_decode_kernel.py).
    assert select_attention_backend("cpu")[0] == "cpu_sdpa_prefill_kernel_decode"
    assert select_attention_backend("cpu", batch_invariant=True)[0] == "batch_invariant"


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_engine_greedy_equals_transformers_greedy(tmp_path, arch):
    """The whole engine (scheduler, paged cache, n-gram speculation with verification windows) on a
    family's decoder continues prompts exactly as transformers' greedy argmax does."""
    from tiny_models import make_llm, mixed_prompts

    from specserve.engine import SamplingParams

    ref = build_tiny_model(tmp_path / "m", arch, seed=5, norm_noise=0.1, tie_word_embeddings=arch == "gemma")
    prompts = mixed_prompts(4, seed=1)
    new_tokens = 12
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(prompt) :])
    llm = make_llm(tmp_path / "m", speculative_method="ngram", num_speculative_tokens=3)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_chat_template=False)
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_bfloat16_logits_equal_transformers(tmp_path, arch):
    """In bf16 the rounding points matter: Gemma multiplies its norm weight in float32 before the cast
    and rounds the sqrt(hidden) embedding factor to bf16 first (hidden 48: sqrt is not exact), Llama
    casts before the weight. One prefill runs the same ops on the same shapes as transformers' SDPA
    path, so the logits must be bitwise equal; getting either rounding point wrong is 1-2 bf16 steps."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(tmp_path, arch, seed=3, with_tokenizer=False, norm_noise=0.1, hidden_size=48)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = load_decoder(tmp_path, torch.bfloat16)
    kv = model.allocate_kv_cache(8 * BLOCK, torch.bfloat16, "cpu")
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = ref.eval()(torch.tensor([ids])).logits[0].float()  # [20, vocab]
        out = _run(model, [(ids, 20)], kv, [list(range(8))])
    assert torch.equal(out, expected), (out - expected).abs().max()


def test_loading_never_imports_dynamo(tmp_path):
    """The loader and the weight-size estimate build the decoder on the meta device. Ops without a C++
    meta kernel there (nn.Embedding's normal_ init, the rope table's arange) fall back to Python and
    import torch._dynamo, ~2 s in every server and CLI process: the meta build must run none of them.
    llama3 has rope scaling; gemma its own norms and embedding scale."""
    import subprocess
    import sys

    for arch in ("llama3", "gemma"):
        build_tiny_model(tmp_path / arch, arch, with_tokenizer=False)
    code = f"""
import sys
from pathlib import Path
import torch
from specserve.engine.models.arch import ArchConfig
from specserve.engine.models.factory import load_decoder
from specserve.engine.weight_size import estimate_weight_bytes
for arch in ("llama3", "gemma"):
    directory = Path({str(tmp_path)!r}) / arch
    estimate_weight_bytes(ArchConfig.from_directory(directory), torch.bfloat16, "int8", float_linears=False)
    load_decoder(directory, torch.bfloat16)
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_sequences_are_attended_in_groups_of_similar_query_length():
    """Padding every query to the batch's longest made decodes pay for a window's rows (and a
    prefill chunk's); decodes, windows and prefill chunks are attended apart."""
    from specserve.engine.attention import query_groups

    assert query_groups([1, 1, 1]) == [[0, 1, 2]]
    assert query_groups([1, 9, 1, 2, 500, 3, 1]) == [[0, 2, 6], [3, 5], [1], [4]]
    assert query_groups([5, 9, 6]) == [[0, 1, 2]]  # within a factor of 2 of the shortest
    grouped = AttentionMetadata.build([1, 9, 1], [10, 20, 5], [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9]], BLOCK)
    # Tokens laid out group after group: the decodes' (flat 0 and 10), then the window's (1-9).
    assert [(a, b) for a, b, _ in grouped.groups] == [(0, 2), (2, 11)]
    assert grouped.group_order.tolist() == [0, 10, *range(1, 10)]
    assert grouped.group_places[grouped.group_order].tolist() == list(range(11))
    # Decodes first, then an admitted prompt: the groups are slices of the batch as it is.
    in_order = AttentionMetadata.build([1, 1, 9], [10, 5, 9], [[0, 1, 2], [3, 4], [5, 6, 7]], BLOCK)
    assert [(a, b) for a, b, _ in in_order.groups] == [(0, 2), (2, 11)]
    assert in_order.group_order is None and in_order.group_places is None
    assert not AttentionMetadata.build([1, 1], [10, 5], [[0, 1, 2], [3, 4]], BLOCK).groups


@pytest.mark.parametrize(
    "q_lens, c_lens, num_groups",
    [
        ([1, 7, 1, 3, 30], [12, 40, 33, 9, 30], 4),  # groups interleaved in the batch: gathered
        ([1, 1, 3, 7, 30], [12, 33, 9, 40, 30], 4),  # group after group already: sliced
    ],
)
@pytest.mark.parametrize(
    "backend", ["paged_attention", "cpu_paged_attention", "kernel", "batch_invariant_paged_attention"]
)
def test_grouped_attention_equals_one_padded_batch(monkeypatch, q_lens, c_lens, num_groups, backend):
    """A prefill chunk, windows and decodes in one step: the same rows grouped or padded together
    (float32, so only the summation order differs)."""
    from specserve.engine import attention

    g = torch.Generator().manual_seed(2)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(q_lens))]
    heads, kv_heads, dim, tokens = 4, 2, 8, sum(q_lens)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    k_cache = torch.randn(16 * 16 * len(q_lens) + 1, kv_heads, dim, generator=g)
    v_cache = torch.randn_like(k_cache)
    grouped_meta = AttentionMetadata.build(q_lens, c_lens, tables, BLOCK, pad_slot=k_cache.shape[0] - 1)
    assert len(grouped_meta.groups) == num_groups
    assert (grouped_meta.group_order is None) == (q_lens == sorted(q_lens))
    if backend == "kernel":
        kernel = attention.default_paged_decode()
        assert kernel is not None
        attend = attention.kernel_paged_attention(kernel)
    else:
        attend = getattr(attention, backend)
    out = attend(q, k, v, k_cache.clone(), v_cache.clone(), grouped_meta, dim**-0.5)
    monkeypatch.setattr(attention, "query_groups", lambda lens: [list(range(len(lens)))])
    padded_meta = AttentionMetadata.build(q_lens, c_lens, tables, BLOCK, pad_slot=k_cache.shape[0] - 1)
    assert not padded_meta.groups
    ref = attend(q, k, v, k_cache.clone(), v_cache.clone(), padded_meta, dim**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_head_major_rows_gather_what_a_gather_by_slot_and_a_permute_do():
    """The decode path gathers K/V with one index_select over the cache viewed as [slots * KVH, D]."""
    from specserve.engine.attention import _gather_context

    cache = torch.randn(40, 3, 8)  # [num_slots, KVH, D]
    meta = AttentionMetadata.build([1, 1], [5, 20], [[1], [0, 2]], 16, pad_slot=39)
    rows = meta.head_major_rows(3)  # [S, KVH, C]
    assert rows.shape == (2, 3, 20) and meta.head_major_rows(3) is rows  # built once a step
    by_rows = cache.view(-1, 8).index_select(0, rows.reshape(-1)).view(2, 3, 20, 8)
    by_slot = _gather_context(cache, meta.context_slots).permute(0, 2, 1, 3)
    assert torch.equal(by_rows, by_slot)
