"""The EAGLE head and proposer: the paged draft path computes what the dense (training) path does,
published checkpoints load as they are, and a head that does not fit the target is a one-line error.
(Greedy equality and the sampled-distribution tests run in test_lossless.py / test_lossless_heldout.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.attention import AttentionMetadata
from specserve.engine.models.arch import ArchConfig
from specserve.engine.proposer import ProposerError
from specserve.engine.runner import padded_num_slots
from specserve.plugins.eagle_head import (
    EagleHead,
    head_arch,
    head_state_dict,
    load_eagle_head,
    save_eagle_head,
)

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def arch(tiny_llama_dir) -> ArchConfig:
    return ArchConfig.from_directory(tiny_llama_dir)


def _random_head(arch: ArchConfig, seed: int, **kwargs) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(head_arch(arch), **kwargs)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms and biases away from their trivial values too
    return head.eval()


@pytest.mark.parametrize("input_norm", [False, True])
def test_paged_chunks_equal_the_dense_forward(arch, input_norm):
    """The proposer's path: a catch-up chunk of pairs, then one pair per draft step, through the paged
    KV cache (block table out of order) gives what one dense causal pass over all pairs gives."""
    head = _random_head(arch, seed=3, input_norm=input_norm)
    length, hidden, block_size = 11, arch.hidden_size, 4
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(length, hidden, generator=g)
    feats = torch.randn(length, hidden, generator=g)
    with torch.no_grad():
        dense = head.forward_dense(embeds[None], feats[None], torch.arange(length))[0]  # [T, hidden]
        cache = head.allocate_kv_cache(padded_num_slots(8 * block_size), torch.float32, "cpu")[0]
        blocks = [5, 2, 7]
        chunks = [(0, 6), (6, 7), (7, 8), (8, 11)]
        paged = []
        for start, end in chunks:
            meta = AttentionMetadata.build(
                [end - start], [end], [blocks], block_size, pad_slot=cache[0].shape[0] - 1
            )
            paged.append(
                head.forward_paged(embeds[start:end], feats[start:end], torch.arange(start, end), cache, meta)
            )
    torch.testing.assert_close(torch.cat(paged), dense, rtol=1e-4, atol=1e-5)


def test_a_window_after_a_gap_attends_only_to_itself(arch):
    """After a bounded catch-up the head attends from the window's first position on: whatever the
    slots before it hold (here random numbers), the window computes what a dense pass over the window
    alone computes, at the same absolute positions."""
    head = _random_head(arch, seed=4)
    length, first, hidden, block_size = 12, 5, arch.hidden_size, 4
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(length, hidden, generator=g)
    feats = torch.randn(length, hidden, generator=g)
    with torch.no_grad():
        window = torch.arange(first, length)
        dense = head.forward_dense(embeds[None, first:], feats[None, first:], window)[0]  # [7, hidden]
        cache = head.allocate_kv_cache(padded_num_slots(8 * block_size), torch.float32, "cpu")[0]
        for c in cache:
            c[:-1].normal_(generator=g)  # stale slots (the pad slot stays zero)
        blocks, paged = [6, 1, 3], []
        for start, end in [(first, 9), (9, 10), (10, 12)]:
            meta = AttentionMetadata.build(
                [end - start],
                [end],
                [blocks],
                block_size,
                pad_slot=cache[0].shape[0] - 1,
                context_starts=[first],
            )
            paged.append(
                head.forward_paged(embeds[start:end], feats[start:end], torch.arange(start, end), cache, meta)
            )
    torch.testing.assert_close(torch.cat(paged), dense, rtol=1e-4, atol=1e-5)


def test_catch_up_after_drafting_was_off_is_bounded(tiny_llama_dir, eagle_head_dir, monkeypatch):
    """Adaptive policy with a random head: the controller turns drafting off and probes now and then.
    A probe feeds at most `max_catch_up` pairs, buffered features past the prompt stay within that
    bound, and the output is still exactly plain greedy output."""
    from tiny_models import make_adaptive_llm

    from specserve.plugins import eagle

    monkeypatch.setattr(eagle, "MAX_CATCH_UP", 4)
    prompts = mixed_prompts(4, seed=5)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, params, use_chat_template=False)]
    llm = make_adaptive_llm(
        tiny_llama_dir,
        speculative_method="eagle",
        speculative_head_path=str(eagle_head_dir),
        num_speculative_tokens=2,
    )
    proposer = llm.engine.proposer
    assert proposer.max_catch_up == 6  # two windows of k + 1
    fed, gaps, buffered = [], [], []
    first_pairs, on_hidden = proposer._first_pairs, proposer.on_hidden_states

    def spy_first_pairs(req):
        start, feats, tokens = first_pairs(req)
        st = proposer._requests[req.request_id]
        if start > len(req.prompt_token_ids):
            fed.append(len(tokens))
            gaps.append(start > st.num_pairs and st.context_start == start)
        return start, feats, tokens

    def spy_on_hidden(req, start, hidden):
        on_hidden(req, start, hidden)
        st = proposer._requests[req.request_id]
        if st.end() > len(req.prompt_token_ids):
            buffered.append(st.end() - max(st.num_pairs, st.start))

    monkeypatch.setattr(proposer, "_first_pairs", spy_first_pairs)
    monkeypatch.setattr(proposer, "on_hidden_states", spy_on_hidden)
    outs = llm.generate(prompts, params, use_chat_template=False)
    assert [o.token_ids for o in outs] == plain
    assert any(gaps), "no probe came after a long enough stretch without drafts"
    assert max(fed) <= 6 and max(buffered) <= 6


def test_saved_head_reloads_bit_exactly(arch, tmp_path):
    head = _random_head(arch, seed=4)
    ids = torch.arange(0, 320, 3)
    save_eagle_head(tmp_path, head, ids, {"trained_by": "test"})
    again, cfg, draft_ids = load_eagle_head(tmp_path, arch)
    assert cfg["trained_by"] == "test" and cfg["num_hidden_layers"] == 1
    assert torch.equal(draft_ids, ids)
    for (name, a), (name_b, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert name == name_b and torch.equal(a, b), name


def _published_checkpoint(path: Path, arch: ArchConfig, head: EagleHead) -> None:
    """What the EAGLE authors publish (yuhuili/EAGLE-LLaMA3-Instruct-8B and kin): a Llama config with
    one layer, pytorch_model.bin with separate q/k/v and gate/up projections, fc with a bias, no input
    norm, and the target's embeddings saved alongside."""
    state = head_state_dict(head)
    assert "layers.0.input_layernorm.weight" not in state
    state["embed_tokens.weight"] = torch.zeros(arch.vocab_size, arch.hidden_size)
    torch.save(state, path / "pytorch_model.bin")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "num_hidden_layers": 1,
        "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "torch_dtype": "float16",
        "bias": True,
    }
    (path / "config.json").write_text(json.dumps(config))


def test_published_layout_loads_and_serves_losslessly(tiny_llama_dir, arch, tmp_path):
    head = _random_head(arch, seed=5)
    names = set(head_state_dict(head))
    assert {
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
    } <= names
    assert {
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
    } <= names
    _published_checkpoint(tmp_path, arch, head)
    loaded, _, draft_ids = load_eagle_head(tmp_path, arch)
    assert draft_ids is None and not loaded.input_norm
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    prompts = mixed_prompts(6, seed=2)
    plain = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_chat_template=False)]
    llm = make_llm(  # method auto: the head's files say EAGLE
        tiny_llama_dir,
        speculative_method="auto",
        speculative_head_path=str(tmp_path),
        num_speculative_tokens=3,
    )
    assert llm.engine.proposer.name == "eagle"
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)] == plain
    assert llm.engine.stats.spec.num_draft_tokens > 0


def test_head_kv_is_counted_in_the_pool(tiny_llama_dir, eagle_head_dir, arch):
    """The head's one-layer KV shares the request's slots: the pool is sized for target + head bytes."""
    llm = make_llm(tiny_llama_dir, speculative_method="eagle", speculative_head_path=str(eagle_head_dir))
    per_token = llm.engine.proposer.kv_bytes_per_token()
    assert per_token == 2 * arch.num_kv_heads * arch.head_dim * 4  # one layer, float32
    assert llm.engine.proposer.kv_cache[0][0].shape[0] == padded_num_slots(llm.engine.num_blocks * 16)


def _broken(tmp_path: Path, arch: ArchConfig, kind: str) -> Path:
    head = _random_head(arch, seed=6)
    save_eagle_head(tmp_path, head, None, {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    if kind == "vocab":
        cfg["vocab_size"] = arch.vocab_size + 64
    elif kind == "hidden":
        from safetensors.torch import save_file

        state = head_state_dict(head)
        state["fc.weight"] = torch.zeros(arch.hidden_size // 2, arch.hidden_size)
        save_file(state, str(tmp_path / "model.safetensors"))
        cfg["hidden_size"] = arch.hidden_size // 2
    elif kind == "eagle3":
        from safetensors.torch import save_file

        save_file(
            {"midlayer.mlp.down_proj.weight": torch.zeros(2, 2), "d2t": torch.zeros(3)},
            str(tmp_path / "model.safetensors"),
        )
    elif kind == "layer":
        from safetensors.torch import save_file

        state = head_state_dict(head)
        state["layers.0.self_attn.q_proj.weight"] = state["layers.0.self_attn.q_proj.weight"][:-4]
        save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("vocab", "vocabulary of 384 tokens, the target has 320"),
        ("hidden", "hidden size 32, the target has 64"),
        ("eagle3", "EAGLE-3 checkpoint"),
        ("layer", "q_proj.weight has 60 rows; the target's layer needs 64"),
    ],
)
def test_head_that_does_not_fit_the_target_is_refused(arch, tmp_path, kind, message):
    with pytest.raises(ProposerError, match=message.replace("(", r"\(")):
        load_eagle_head(_broken(tmp_path, arch, kind), arch)


def test_misfit_head_is_a_one_line_startup_error(tiny_llama_dir, arch, tmp_path):
    path = _broken(tmp_path, arch, "hidden")
    r = subprocess.run(
        [sys.executable, "-m", "specserve.api.cli", "generate", "--model-path", str(tiny_llama_dir)]
        + ["--prompt", "x", "--speculative-method", "eagle", "--speculative-head-path", str(path)]
        + ["--quantization-encoding", "float32", "--max-kv-cache-tokens", "512"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if "specserve: error:" in ln]
    assert "hidden size 32, the target has 64" in line
    assert "Traceback" not in r.stderr


def test_eagle_without_a_head_path_is_refused(tiny_llama_dir):
    with pytest.raises(ProposerError, match="needs --speculative-head-path"):
        make_llm(tiny_llama_dir, speculative_method="eagle")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_layers(tmp_path, family):
    """Qwen2's q/k/v biases and Qwen3's q/k norms go through the head's layer, its checkpoint names and
    the serving path: a saved head reloads exactly and greedy speculation still equals plain."""
    from tiny_models import build_tiny_model

    model_dir = tmp_path / family
    build_tiny_model(model_dir, family, seed=1)
    arch = ArchConfig.from_directory(model_dir)
    head = _random_head(arch, seed=9)
    names = set(head_state_dict(head))
    extra = {"qwen2": "layers.0.self_attn.q_proj.bias", "qwen3": "layers.0.self_attn.q_norm.weight"}[family]
    assert extra in names
    save_eagle_head(tmp_path / "head", head, None, {})
    again, _, _ = load_eagle_head(tmp_path / "head", arch)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    prompts = mixed_prompts(4, seed=5)
    plain = [o.token_ids for o in make_llm(model_dir).generate(prompts, GREEDY, use_chat_template=False)]
    llm = make_llm(model_dir, speculative_method="eagle", speculative_head_path=str(tmp_path / "head"))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)] == plain
    assert llm.engine.stats.spec.num_draft_tokens > 0
