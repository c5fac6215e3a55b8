"""`train-draft --method medusa` on the tiny target: training lowers the held-out loss, a head trained
on a repeating pattern drafts it (acceptance ~1), the saved head reloads bit-exactly, a truncated
draft vocabulary keeps greedy and sampled output exactly the target's, and a head for another target
is a one-line start-up error."""

from __future__ import annotations

import pytest
import torch
from heldout_helpers import exact_prefix_probs, gof_p_value, hf_model, seeded
from test_lossless_heldout import LENGTHS, P_MIN, PROMPT, SETS
from tiny_models import build_tiny_model, make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.proposer import ProposerError
from specserve.plugins.medusa import load_medusa_heads
from specserve.plugins.medusa_data import (
    Example,
    TrainingData,
    distill,
    distill_prompts,
    frequency_ranked_vocab,
)
from specserve.plugins.medusa_features import RECORDER, FeatureCache
from specserve.plugins.medusa_training import MedusaTrainConfig, head_labels, train_medusa

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _config(output, model_dir, **overrides) -> MedusaTrainConfig:
    base = dict(
        output=output,
        model_path=str(model_dir),
        num_heads=3,
        code_tokens=3000,
        seq_len=128,
        eval_every=5,
        progress=False,
        cache_dir=str(model_dir.parent / f"{model_dir.name}-cache"),
    )
    return MedusaTrainConfig(**(base | overrides))


def _greedy_data(model_dir, prompts: list[list[int]], tokens: int, copies: int = 1) -> TrainingData:
    """The target's own greedy continuations (what a Medusa head drafts at inference)."""
    llm = make_llm(model_dir)
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), False)
    data = TrainingData()
    data.add([Example(p + o.token_ids, "distilled") for p, o in zip(prompts, outs, strict=True)] * copies)
    return data


def test_head_labels_follow_the_proposer_convention():
    """Head i at position t is trained on token t + i + 2 (plugins/medusa.py: head i proposes the
    token i + 1 places after the last one, whose hidden state is at t = its position - 1)."""
    labels = head_labels([[10, 11, 12, 13, 14]], num_heads=2)
    assert labels.tolist() == [[12, 13, 14, -100, -100], [13, 14, -100, -100, -100]]


def test_a_few_steps_lower_the_heldout_loss(tiny_llama_dir, tmp_path):
    report = train_medusa(_config(tmp_path / "head", tiny_llama_dir, max_steps=10))
    first, last = report["curve"][0]["all"], report["heldout"]["all"]
    assert report["training"]["steps"] == 10 and report["curve"][0]["step"] == 0
    assert all(b < a for a, b in zip(first["loss"], last["loss"], strict=True)), (first["loss"], last["loss"])
    assert report["data"]["sources"]["code"]["heldout_sequences"] >= 1
    assert "Python Software Foundation" in report["data"]["code_licence"]


def test_resume_continues_from_the_checkpoint(tiny_llama_dir, tmp_path):
    out = tmp_path / "head"
    first = train_medusa(_config(out, tiny_llama_dir, max_steps=5))
    with pytest.raises(ValueError, match="--resume"):
        train_medusa(_config(out, tiny_llama_dir, max_steps=8))
    again = train_medusa(_config(out, tiny_llama_dir, max_steps=8, resume=True))
    assert again["training"]["steps"] == 8
    assert again["training"]["tokens_seen"] > first["training"]["tokens_seen"]
    assert [p["step"] for p in again["curve"]] == [0, 5, 8]


@pytest.fixture(scope="module")
def pattern_head(tiny_llama_dir, tmp_path_factory):
    """Heads trained to memorise the target's greedy continuation of one prompt."""
    prompt = [5, 6, 7, 8]
    data = _greedy_data(tiny_llama_dir, [prompt], tokens=120, copies=4)
    out = tmp_path_factory.mktemp("pattern-head")
    cfg = _config(
        out, tiny_llama_dir, max_steps=150, lr=1e-2, projection_lr=1e-2, batch_size=3, eval_every=50
    )
    report = train_medusa(cfg, data=data)
    return out, prompt, report


def test_head_trained_on_a_repeating_pattern_is_accepted(tiny_llama_dir, pattern_head):
    out, prompt, report = pattern_head
    assert report["heldout"]["all"]["top1"] == [1.0, 1.0, 1.0]
    llm = make_llm(
        tiny_llama_dir, speculative_method="medusa", medusa_heads_path=str(out), num_speculative_tokens=3
    )
    plain = make_llm(tiny_llama_dir).generate(
        [prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), False
    )
    outs = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), False)
    assert outs[0].token_ids == plain[0].token_ids
    assert llm.engine.stats.spec.acceptance_rate >= 0.95


def test_saved_head_reloads_bit_exactly(tiny_llama_dir, pattern_head):
    """The heads the trainer ended with (its resume state; the saved step is the last one here) are
    the proposer's heads, bit for bit."""
    out, _, report = pattern_head
    assert report["training"]["saved_step"] == report["training"]["steps"]
    trained = torch.load(out / "checkpoint" / "state.pt", weights_only=True)["heads"]
    llm = make_llm(tiny_llama_dir, speculative_method="medusa", medusa_heads_path=str(out))
    loaded = llm.engine.proposer.heads.state_dict()
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)


def test_the_best_evaluation_is_the_saved_head(tiny_llama_dir, tmp_path):
    report = train_medusa(_config(tmp_path / "head", tiny_llama_dir, max_steps=10, eval_every=3))
    scores = {p["step"]: p["all"]["expected_acceptance_length"] for p in report["curve"]}
    assert list(scores) == [0, 3, 6, 9, 10]
    best = report["training"]["saved_step"]
    assert scores[best] == max(scores.values()) and report["heldout"]["step"] == best
    assert report["final_step_heldout"]["step"] == 10


@pytest.fixture(scope="module")
def truncated_head(tiny_llama_dir, tmp_path_factory):
    """A 48-token draft vocabulary (of 320), trained briefly on greedy continuations and PROMPT."""
    data = _greedy_data(tiny_llama_dir, [*mixed_prompts(12, seed=7), PROMPT], tokens=40)
    out = tmp_path_factory.mktemp("truncated-head")
    train_medusa(_config(out, tiny_llama_dir, max_steps=40, lr=5e-3, draft_vocab_size=48), data=data)
    return out


def test_truncated_vocabulary_is_saved_and_used(tiny_llama_dir, truncated_head):
    heads, cfg, ids = load_medusa_heads(truncated_head, hidden=64, vocab=320)
    assert ids is not None and len(ids) == 48 and heads[0][-1].weight.shape == (48, 64)
    data = torch.load(truncated_head / "checkpoint" / "data.pt", weights_only=True)
    assert torch.equal(ids, frequency_ranked_vocab(TrainingData.from_state(data["data"]).train, 320, 48))
    llm = make_llm(tiny_llama_dir, speculative_method="medusa", medusa_heads_path=str(truncated_head))
    llm.generate(mixed_prompts(4, seed=2), GREEDY, use_chat_template=False)
    assert llm.engine.stats.spec.num_draft_tokens > 0


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 48},
        {"max_kv_cache_tokens": 224, "max_length": 96},
    ],
    ids=["chunked", "preempting"],
)
def test_truncated_vocabulary_greedy_equals_plain(tiny_llama_dir, truncated_head, engine_kwargs):
    prompts = mixed_prompts(16, seed=1)
    plain = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_chat_template=False)]
    llm = make_llm(
        tiny_llama_dir,
        speculative_method="medusa",
        medusa_heads_path=str(truncated_head),
        num_speculative_tokens=3,
        **engine_kwargs,
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)] == plain
    assert llm.engine.stats.spec.num_accepted_tokens > 0


def test_truncated_vocabulary_sampled_output_follows_the_target(tiny_llama_dir, truncated_head):
    """Sampled drafts from the truncated head (q zero outside its 48 tokens): the first 2 and 3 output
    tokens fit the plain sampler's exact law (test_lossless_heldout's reference and sets)."""
    model = hf_model(tiny_llama_dir)
    llm = make_llm(
        tiny_llama_dir,
        speculative_method="medusa",
        medusa_heads_path=str(truncated_head),
        num_speculative_tokens=3,
        max_batch_size=256,
    )
    n = 300
    params = [
        x
        for pair in zip(seeded(SETS["A"], n, 8_000_000), seeded(SETS["B"], n, 8_002_000), strict=True)
        for x in pair
    ]
    outs = llm.generate([PROMPT] * len(params), params, use_chat_template=False)
    spec = llm.engine.stats.spec
    assert spec.num_draft_tokens > 0 and 0 < spec.acceptance_rate < 1
    for k, name in enumerate(("A", "B")):
        got = [tuple(o.token_ids) for o in outs[k::2]]
        for length in LENGTHS:
            exact = exact_prefix_probs(model, PROMPT, SETS[name], length)
            p = gof_p_value([g[:length] for g in got], exact)
            assert p > P_MIN, f"set {name}, first {length} tokens: p={p:.2e}"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_size": 32, "intermediate_size": 64}, "hidden size"),
        ({"vocab_size": 300}, "vocabulary|tokens"),
    ],
    ids=["hidden", "vocab"],
)
def test_head_for_another_target_is_a_one_line_error(
    tmp_path, truncated_head, pattern_head, medusa_heads_dir, overrides, match
):
    """Saved by train-draft (config names hidden and vocabulary sizes) or in the published layout
    (config without vocab_size: the projection's shape tells)."""
    other = tmp_path / "other"
    build_tiny_model(other, "llama", seed=3, **overrides)
    for head in (truncated_head, pattern_head[0], medusa_heads_dir):
        with pytest.raises(ProposerError, match=match) as info:
            make_llm(other, speculative_method="medusa", medusa_heads_path=str(head))
        assert "\n" not in str(info.value)


def test_distilled_features_are_what_the_engine_hands_the_proposer(tiny_llama_dir):
    """The recorder keeps the engine's last_hidden for every answer token: row j (position
    len(prompt) - 1 + j) equals a teacher-forced prefill forward over prompt + answer at that position."""
    llm = make_llm(tiny_llama_dir, speculative_method=RECORDER, num_speculative_tokens=1)
    prompts = distill_prompts(3)
    examples = distill(llm, llm.engine.proposer, prompts, max_tokens=12, progress=False)
    assert {e.source for e in examples} == {"distilled/chat", "distilled/code", "distilled/maths"}
    cache = FeatureCache(llm.engine.model, llm.engine.device, torch.float32)
    for i, ex in enumerate(examples):
        assert ex.features.shape[0] >= 10 and ex.start == len(ex.tokens) - 12 - 1
        (prefill,) = cache.get([("x", i)], [ex.tokens], [ex.start])
        rows = ex.features.shape[0]
        torch.testing.assert_close(ex.features.float(), prefill[:rows].float(), atol=2e-2, rtol=2e-2)
