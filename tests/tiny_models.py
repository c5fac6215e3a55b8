"""Tiny random-weight models and a tiny trained BPE tokenizer, built in-process for tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Speculative decoding drafts several tokens and verifies them at once. ",
    "def add(a, b):\n    return a + b\n",
    "Bonjour, comment ça va? Très bien, merci! ",
    "1 2 3 4 5 6 7 8 9 10 11 12 ",
    "日本語のテキストも少し。 ",
]


def build_tokenizer(directory: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 320, **overrides):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":
        return LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if arch == "gemma":
        from transformers import GemmaConfig

        # head_dim 32 != hidden / heads (16), as in the released models (256 vs 2048 / 8).
        return GemmaConfig(head_dim=32, **common)
    raise ValueError(arch)


def build_tiny_model(
    directory: Path,
    arch: str = "llama",
    seed: int = 0,
    with_tokenizer: bool = True,
    norm_noise: float = 0.0,
    **overrides,
):
    """Write a random-weight HF model (+ tokenizer) to `directory`; return the transformers model.
    `norm_noise` > 0 perturbs the norm weights too (their init is constant), so a parity test sees
    whether each norm's weight is applied the way the family applies it."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init is small; scale weights up so greedy choices are not all near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            elif norm_noise:
                p.add_(torch.randn_like(p), alpha=norm_noise)
    model.eval()
    model.save_pretrained(directory)
    if with_tokenizer:
        build_tokenizer(directory, vocab_size=cfg.vocab_size)
    return model


def perturb_weights(model, noise: float, seed: int = 1) -> None:
    """Add Gaussian noise (std `noise`) to every weight but the norms', in place: a copy of a tiny
    target that agrees with it often, not always (a draft for the speculation tests)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * noise)


def make_llm(model_dir: Path, **kwargs):
    """An LLM on a tiny model in float32 with a fixed, small KV cache (not sized from memory)."""
    from specserve.engine import LLM

    kwargs.setdefault("quantization_encoding", "float32")
    kwargs.setdefault("max_kv_cache_tokens", 4096)
    kwargs.setdefault("speculative_method", "none")
    # Tests of speculation pin the policy they test; the static one drafts every step (deterministic).
    kwargs.setdefault("speculative_policy", "static")
    # Quantized loads cache packed layers: keep them beside the tiny model, not in ~/.cache.
    kwargs.setdefault("cache_dir", str(Path(model_dir).parent / f"{Path(model_dir).name}-cache"))
    return LLM(str(model_dir), **kwargs)


def mixed_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths, some with repeats so n-gram lookup finds matches."""
    import random

    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.randint(3, 60)
        base = [rng.randrange(3, 300) for _ in range(max(2, length // 3))]
        prompts.append((base * 4)[:length] if i % 2 else [rng.randrange(3, 300) for _ in range(length)])
    return prompts


def sloped_step_cost(slope: float = 0.1):
    """A cost model that ignores measurements: a forward costs 1 + slope x tokens, drafting is free.

    With it the adaptive controller's choices depend on acceptance alone (and not on this machine's
    timing), and they differ between requests and steps, which is what the lossless tests need."""
    from specserve.engine.step_cost_model import Promise, StepCostModel

    class SlopedStepCost(StepCostModel):
        def observe_target(
            self, num_sequences: int, num_tokens: int, seconds: float, prefill_tokens: int | None = None
        ) -> None:
            pass

        def observe_draft(
            self, num_requests: int, num_steps: int, seconds: float, setup_tokens: int = 0
        ) -> None:
            pass

        def observe_probe(self, num_probes: int, seconds: float, setup_tokens: int = 0) -> None:
            pass

        def observe_realized(
            self,
            num_sequences: int,
            drafted: bool,
            tokens: int,
            seconds: float,
            promised: Promise | None = None,
        ) -> None:
            pass

        def observe_overhead(self, seconds: float) -> None:
            pass

    return SlopedStepCost([(1, 1.0), (1024, 1.0 + slope * 1023)], draft_cost_ratio=0.0)


def make_adaptive_llm(model_dir: Path, slope: float = 0.1, quiet_share: float = math.inf, **kwargs):
    """make_llm with the adaptive policy deciding on `sloped_step_cost` (deterministic k choices).
    Quiet spells (SpeculationController.quiet_decision) start where the controller's own time is a
    share of a step, which is this machine's timing: off unless a test asks for them (0.0: always)."""
    llm = make_llm(model_dir, speculative_policy="adaptive", **kwargs)
    assert llm.engine.controller is not None, "no proposer, so no controller"
    llm.engine.controller.cost = sloped_step_cost(slope)
    llm.engine.controller.quiet_share = quiet_share
    return llm
