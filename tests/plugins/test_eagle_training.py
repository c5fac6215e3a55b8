"""`train-draft --method eagle` on the tiny target: the unrolled training forward is the proposer's
chain, training lowers the loss, a head trained on a repeating pattern drafts it (held-out acceptance
~1, served greedy output equals plain with more accepted than an untrained head), the saved head
reloads bit-exactly, and a truncated draft vocabulary is saved with it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llm

from specserve.engine import SamplingParams
from specserve.engine.models.arch import ArchConfig
from specserve.plugins.eagle_head import EagleHead, head_arch, load_eagle_head, save_eagle_head
from specserve.plugins.eagle_training import (
    EagleTrainConfig,
    chain_mask,
    init_near_identity,
    train_eagle,
    unrolled_forward,
)
from specserve.plugins.medusa_data import Example, TrainingData

GREEDY = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)


def _config(output, model_dir, **overrides) -> EagleTrainConfig:
    base = dict(
        output=output,
        model_path=str(model_dir),
        code_tokens=3000,
        seq_len=128,
        eval_every=5,
        eval_positions=4,
        progress=False,
        cache_dir=str(model_dir.parent / f"{model_dir.name}-cache"),
    )
    return EagleTrainConfig(**(base | overrides))


@pytest.fixture(scope="module")
def arch(tiny_llama_dir) -> ArchConfig:
    return ArchConfig.from_directory(tiny_llama_dir)


def _random_head(arch, seed: int) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(head_arch(arch))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


def test_chain_mask_small_case():
    """Depth 2 at q sees the real pairs up to q - 1 and itself; depth 1 is causal."""
    m = chain_mask(3, 2).int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]


def test_unrolled_forward_is_the_drafting_chain(arch):
    """Depth 1 is forward_dense; depth d at q is forward_dense over the real pairs up to q - d + 1
    followed by the head's own predictions fed back (what the proposer drafts from)."""
    head = _random_head(arch, seed=3)
    length, hidden, depths = 9, arch.hidden_size, 3
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, length, hidden, generator=g)
    feats = torch.randn(1, length, hidden, generator=g)
    with torch.no_grad():
        outs = unrolled_forward(head, embeds, feats, torch.ones(1, length, dtype=torch.bool), depths)
        dense = head.forward_dense(embeds, feats, torch.arange(length))
        torch.testing.assert_close(outs[0], dense, rtol=1e-4, atol=1e-5)
        for p in range(length - depths + 1):  # the chain that starts after real pair p
            chain_feats = feats[:, : p + 1]
            for d in range(2, depths + 1):
                n = chain_feats.shape[1]
                prev = head.forward_dense(embeds[:, :n], chain_feats, torch.arange(n))[:, -1:]
                chain_feats = torch.cat([chain_feats, prev], dim=1)
                q = p + d - 1
                want = head.forward_dense(embeds[:, : q + 1], chain_feats, torch.arange(q + 1))[0, -1]
                torch.testing.assert_close(outs[d - 1][0, q], want, rtol=1e-4, atol=1e-5)


def test_a_few_steps_lower_the_loss(tiny_llama_dir, tmp_path):
    report = train_eagle(_config(tmp_path / "head", tiny_llama_dir, max_steps=10))
    first, last = report["curve"][0]["all"], report["final_step_heldout"]["all"]
    assert report["training"]["steps"] == 10 and report["curve"][0]["step"] == 0
    assert last["feature_loss"] < first["feature_loss"], (first, last)
    assert len(last["top1"]) == 4 and last["chains"] > 0
    assert "Python Software Foundation" in report["data"]["code_licence"]


def test_resume_continues_from_the_checkpoint(tiny_llama_dir, tmp_path):
    out = tmp_path / "head"
    first = train_eagle(_config(out, tiny_llama_dir, max_steps=3, code_tokens=1500))
    with pytest.raises(ValueError, match="--resume"):
        train_eagle(_config(out, tiny_llama_dir, max_steps=5, code_tokens=1500))
    with pytest.raises(ValueError, match="unroll"):
        train_eagle(_config(out, tiny_llama_dir, max_steps=5, code_tokens=1500, unroll=1, resume=True))
    again = train_eagle(_config(out, tiny_llama_dir, max_steps=5, code_tokens=1500, resume=True))
    assert again["training"]["steps"] == 5
    assert again["training"]["tokens_seen"] > first["training"]["tokens_seen"]
    assert [p["step"] for p in again["curve"]] == [0, 3, 5]


def _greedy_data(model_dir, prompts, tokens: int, copies: int) -> TrainingData:
    llm = make_llm(model_dir)
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), False)
    data = TrainingData()
    data.add(
        [Example(p + o.token_ids, "distilled", len(p) - 1) for p, o in zip(prompts, outs, strict=True)]
        * copies
    )
    return data


@pytest.fixture(scope="module")
def pattern_head(tiny_llama_dir, tmp_path_factory):
    """A head trained to draft the target's greedy continuation of one prompt (a repeating pattern)."""
    prompt = [5, 6, 7, 8]
    data = _greedy_data(tiny_llama_dir, [prompt], tokens=100, copies=4)
    out = tmp_path_factory.mktemp("eagle-pattern-head")
    cfg = _config(out, tiny_llama_dir, max_steps=160, lr=5e-3, batch_size=3, eval_every=40)
    report = train_eagle(cfg, data=data)
    return out, prompt, report


def test_head_trained_on_a_repeating_pattern_is_accepted(tiny_llama_dir, pattern_head, tmp_path, arch):
    out, prompt, report = pattern_head
    assert report["curve"][0]["all"]["expected_acceptance_length"] < 2.0
    assert (
        report["heldout"]["all"]["expected_acceptance_length"] >= 4.0
    )  # of 5 = 1 + 4 positions; an untrained head: ~1.1
    plain = make_llm(tiny_llama_dir).generate([prompt], GREEDY, False)[0].token_ids
    untrained = tmp_path / "untrained"
    torch.manual_seed(0)
    head = EagleHead(head_arch(arch))
    init_near_identity(head)
    save_eagle_head(untrained, head, None, {})
    rates = []
    for path in (out, untrained):
        llm = make_llm(
            tiny_llama_dir,
            speculative_method="eagle",
            speculative_head_path=str(path),
            num_speculative_tokens=4,
        )
        assert llm.generate([prompt], GREEDY, False)[0].token_ids == plain
        rates.append(llm.engine.stats.spec.acceptance_rate)
    assert rates[0] >= 0.8 and rates[0] > rates[1] + 0.3, rates


def test_saved_head_reloads_bit_exactly(tiny_llama_dir, tmp_path, arch):
    """The head the trainer ended with (its resume state; a tiny lr keeps the held-out score tied, so
    the saved evaluation is the last one) is the one load_eagle_head returns, bit for bit."""
    out = tmp_path / "head"
    report = train_eagle(_config(out, tiny_llama_dir, max_steps=1, eval_every=1, lr=1e-7, code_tokens=1500))
    assert report["training"]["saved_step"] == report["training"]["steps"] == 1
    trained = torch.load(out / "checkpoint" / "state.pt", weights_only=True)["heads"]
    loaded, cfg, ids = load_eagle_head(out, arch)
    assert ids is None and cfg["num_hidden_layers"] == 1
    state = loaded.state_dict()
    assert trained.keys() == state.keys()
    assert all(torch.equal(trained[k], state[k]) for k in trained)


def test_truncated_vocabulary_is_saved_and_served(tiny_llama_dir, tmp_path, arch):
    out = tmp_path / "head"
    report = train_eagle(_config(out, tiny_llama_dir, max_steps=3, code_tokens=1500, draft_vocab_size=48))
    assert report["head"]["draft_vocab_size"] == 48
    _, _, ids = load_eagle_head(out, arch)
    assert ids is not None and len(ids) == 48
    llm = make_llm(tiny_llama_dir, speculative_method="eagle", speculative_head_path=str(out))
    plain = make_llm(tiny_llama_dir).generate([[5, 6, 7, 8]], GREEDY, False)[0].token_ids
    assert llm.generate([[5, 6, 7, 8]], GREEDY, False)[0].token_ids == plain
    assert llm.engine.stats.spec.num_draft_tokens > 0
