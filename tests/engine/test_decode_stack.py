"""A bf16 CPU decoder's layers as one C call (engine/decode_stack.c): the same hidden states and KV cache
as the modules bit for bit, for decodes, windows and mixed steps, on int4 (a draft's) and bf16 (a
target's) layers; prefill chunks and what it does not take run the modules; where the loader installs
it; and speculative decoding through it gives the tokens it gives without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.engine import decode_stack
from specserve.engine.attention import cpu_paged_attention
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.decode_stack import DecodeStack, default_decode_stack_kernel, use_decode_stack
from specserve.engine.int4_kernel import default_int4_kernel
from specserve.engine.models.layers import bind_attention
from specserve.engine.models.small_batch_linear import MAX_KERNEL_ROWS
from specserve.engine.paged_decode_kernel import default_paged_decode
from specserve.engine.runner import SequenceInput, forward_sequences
from specserve.engine.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_model, make_llm, perturb_weights

BLOCK = 16
# head_dim 32: the smallest the paged-decode kernel's bf16 path takes; inputs a multiple of int4's groups.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)

pytestmark = pytest.mark.skipif(
    default_int4_kernel() is None or default_paged_decode() is None or default_decode_stack_kernel() is None,
    reason="needs the C kernels' AVX512-BF16 paths",
)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stack-qwen2")
    build_tiny_model(path, "qwen2", seed=3, norm_noise=0.1, **SHAPE)  # q/k/v with biases
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stack-llama")
    build_tiny_model(path, "llama", seed=4, with_tokenizer=False, norm_noise=0.1, **SHAPE)
    return path


@pytest.fixture(scope="module")
def qwen2_draft_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stack-qwen2-draft")
    model = build_tiny_model(path, "qwen2", seed=3, norm_noise=0.1, **SHAPE)
    perturb_weights(model, 0.02)
    model.save_pretrained(path)
    return path


def _load(directory: Path, encoding: str, draft: bool = False, batch_invariant: bool = False):
    spec = ModelSpec(model_path=str(directory), quantization_encoding=encoding)
    cache = str(directory.parent / f"{directory.name}-cache")
    return load_model(spec, cache, batch_invariant=batch_invariant, draft=draft).model


def _twin_caches(model, contexts: list[int]):
    """Two KV caches holding the same prompts (prefilled by the modules), and each prompt's blocks."""
    tables = [list(range(32 * i, 32 * (i + 1))) for i in range(len(contexts))]
    caches = [
        model.allocate_kv_cache(32 * BLOCK * len(contexts) + 1, torch.bfloat16, "cpu") for _ in range(2)
    ]
    for cache in caches:
        for i, (table, length) in enumerate(zip(tables, contexts, strict=True)):
            prompt = [(7 * i + 3 * t) % 300 + 3 for t in range(length)]
            forward_sequences(model, cache, [SequenceInput(prompt, 0, table, 1)], BLOCK)
    return caches, tables


def _same_caches(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize(
    ("family", "encoding", "draft"),
    [
        ("qwen2", "int4", True),
        ("qwen2", "bfloat16", False),
        ("llama", "bfloat16", False),
        ("llama", "int4", False),
    ],
)
def test_steps_of_decodes_and_windows_are_the_modules_bit_for_bit(
    qwen2_dir, llama_dir, family, encoding, draft
):
    model = _load(qwen2_dir if family == "qwen2" else llama_dir, encoding, draft)
    stack = model.decode_stack
    assert isinstance(stack, DecodeStack)
    contexts = [40, 17, 63, 5]
    (ours, theirs), tables = _twin_caches(model, contexts)
    steps = [
        [(0, [5], 1)],  # one decode
        [(i, [9 + i], 1) for i in range(4)],  # decodes at four contexts
        [(1, [4, 8, 15, 16], 4)],  # a verification window
        [(0, [11], 1), (2, [3, 4, 5, 6, 7, 8], 6), (3, [12, 13], 2)],  # decodes beside windows (grouped)
        [(2, list(range(20, 36)), 16)],  # a window of SMALL_QUERY_ROWS rows
        [(i, list(range(40 + i, 56 + i)), 16) for i in range(4)],  # 64 rows of windows
    ]
    for step in steps:
        seqs = [SequenceInput(tokens, contexts[i], tables[i], outputs) for i, tokens, outputs in step]
        model.decode_stack = stack
        got = forward_sequences(model, ours, seqs, BLOCK)
        model.decode_stack = None
        expected = forward_sequences(model, theirs, seqs, BLOCK)
        assert torch.equal(got, expected), step
        assert _same_caches(ours, theirs), step
        for i, tokens, _ in step:
            contexts[i] += len(tokens)


def test_a_step_with_a_prefill_chunk_or_too_many_rows_runs_the_modules(qwen2_dir):
    model = _load(qwen2_dir, "bfloat16")
    stack = model.decode_stack
    # The stack takes as many rows as the bf16 kernel does (SmallBatchLinear).
    assert stack is not None and stack.max_rows == MAX_KERNEL_ROWS
    (cache, _), tables = _twin_caches(model, [10, 10])

    def called(seqs) -> bool:  # whether the stack took the step
        from specserve.engine.runner import ragged_batch

        ids, positions, _, meta = ragged_batch(seqs, BLOCK, "cpu", pad_slot=cache[0][0].shape[0] - 1)
        embedded = model.embed_tokens(ids)
        return stack(embedded, positions, cache, meta) is not None

    assert called([SequenceInput([3], 10, tables[0], 1)])
    assert not called([SequenceInput(list(range(3, 20)), 10, tables[0], 1)])  # 17 query rows: a prefill chunk
    assert not called(
        [SequenceInput([3], 10, tables[0], 1), SequenceInput(list(range(3, 30)), 10, tables[1], 1)]
    )
    windows = MAX_KERNEL_ROWS // 13 + 1  # windows of 13 rows, more rows than the kernel takes
    big = [SequenceInput(list(range(3, 16)), 10, tables[i % 2], 13) for i in range(windows)]
    assert not called(big)


def test_a_position_outside_the_rope_table_raises_as_the_modules_do(qwen2_dir):
    model = _load(qwen2_dir, "bfloat16")
    assert model.decode_stack is not None
    (cache, _), tables = _twin_caches(model, [10])
    table_rows = model.layers[0].self_attn.rope.cos.shape[0]
    far = [SequenceInput([3], table_rows, list(range(table_rows // BLOCK + 2)), 1)]
    big_cache = model.allocate_kv_cache((table_rows // BLOCK + 2) * BLOCK + 1, torch.bfloat16, "cpu")
    with pytest.raises(IndexError):
        forward_sequences(model, big_cache, far, BLOCK)
    model.decode_stack = None
    with pytest.raises(IndexError):
        forward_sequences(model, big_cache, far, BLOCK)


def test_a_model_bound_to_another_attention_runs_the_modules(qwen2_dir):
    model = _load(qwen2_dir, "bfloat16")
    (ours, theirs), tables = _twin_caches(model, [12])
    bind_attention(model.layers, model.config, "cpu", cpu_paged_attention)
    seqs = [SequenceInput([3], 12, tables[0], 1)]
    got = forward_sequences(model, ours, seqs, BLOCK)  # the stack declines: matmul attention, as bound
    use_decode_stack(model, None)
    assert torch.equal(got, forward_sequences(model, theirs, seqs, BLOCK))


def test_a_kv_cache_it_does_not_read_runs_the_modules(qwen2_dir):
    """A float32 cache beside a bf16 model (the modules cast into it and attend with matmuls)."""
    model = _load(qwen2_dir, "bfloat16")
    stack = model.decode_stack
    assert stack is not None
    caches = [model.allocate_kv_cache(32 * BLOCK + 1, torch.float32, "cpu") for _ in range(2)]
    outputs = []
    for cache, installed in zip(caches, (stack, None), strict=True):
        model.decode_stack = installed
        forward_sequences(model, cache, [SequenceInput(list(range(3, 30)), 0, list(range(32)), 1)], BLOCK)
        outputs.append(forward_sequences(model, cache, [SequenceInput([7], 27, list(range(32)), 1)], BLOCK))
    assert torch.equal(outputs[0], outputs[1]) and _same_caches(*caches)


def test_the_loader_installs_it_only_where_every_layer_runs_our_kernels(qwen2_dir, llama_dir, tmp_path):
    assert _load(qwen2_dir, "bfloat16").decode_stack is not None
    assert _load(qwen2_dir, "int4", draft=True).decode_stack is not None
    assert _load(qwen2_dir, "float32").decode_stack is None  # float32 layers run torch's
    assert _load(qwen2_dir, "int8").decode_stack is None  # torch's int8 kernel
    assert _load(llama_dir, "bfloat16", batch_invariant=True).decode_stack is None  # its own attention
    for arch in ("qwen3", "gemma"):  # q/k norms; Gemma's norm and GeGLU
        build_tiny_model(tmp_path / arch, arch, seed=5, with_tokenizer=False, **SHAPE)
        assert _load(tmp_path / arch, "bfloat16").decode_stack is None, arch


def test_switched_off_models_run_the_modules(switch_kernel_off, qwen2_dir):
    switch_kernel_off("SPECSERVE_DECODE_STACK", decode_stack.default_decode_stack_kernel)
    assert _load(qwen2_dir, "bfloat16").decode_stack is None


def test_speculation_through_the_stack_gives_the_tokens_it_gives_without(qwen2_dir, qwen2_draft_dir):
    """A bf16 target and its int4 draft, both on the stack: greedy speculation gives plain greedy's
    tokens (every kernel is row-invariant), and greedy and seeded sampling give what the same engine
    gives with the modules. (One engine for both: a draft's float routing is timed at load, and sampled
    speculation's tokens depend on what the draft proposed.)"""
    llm = make_llm(
        qwen2_dir,
        quantization_encoding="bfloat16",
        speculative_method="draft_model",
        draft_model_path=str(qwen2_draft_dir),
        draft_quantization_encoding="int4",
        num_speculative_tokens=4,
    )
    models = [llm.engine.model, llm.engine.proposer.model]
    stacks = [m.decode_stack for m in models]
    assert all(isinstance(s, DecodeStack) for s in stacks)
    prompts = [[(5 * i + 7 * t) % 300 + 3 for t in range(12 + 9 * i)] for i in range(3)]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative_enabled=False),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
    ]

    def generate() -> list[list[int]]:
        return [o.token_ids for p in params for o in llm.generate(prompts, p, use_chat_template=False)]

    stacked = generate()
    assert stacked[3:6] == stacked[0:3]  # speculative greedy = plain greedy
    accepted = llm.engine.stats.spec.num_accepted_tokens
    assert accepted > 0
    for model in models:
        use_decode_stack(model, None)
    assert generate() == stacked
    assert llm.engine.stats.spec.num_accepted_tokens == 2 * accepted  # the same drafts accepted again
