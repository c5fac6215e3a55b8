"""Exact reference distributions for the held-out lossless tests (test_lossless_heldout.py).

The reference is the plain sampler itself: the target's logits (recomputed with transformers from the
same HF directory, float32) pushed through `apply_penalties_and_bias` + `logits_to_probs` with the
tokens generated so far as context, exactly what plain decoding samples each token from. Enumerating
the support of the first L tokens (small with top_k) gives the exact probability of every L-token
prefix, so the speculative engine's empirical prefix counts can be tested against it directly
(goodness of fit), with no sampling noise on the reference side.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from scipy import stats

from specserve.engine import SamplingParams
from specserve.engine.sampler import RowContext, apply_penalties_and_bias, logits_to_probs

_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(model_dir: Path) -> torch.nn.Module:
    """The tiny target as transformers loads it (float32, eval), cached per directory."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _MODELS[key]


@contextmanager
def _one_thread() -> Iterator[None]:
    """The reference forwards are tiny: one thread avoids OpenMP spin-waits on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@torch.inference_mode()
def last_logits(model: torch.nn.Module, sequences: list[list[int]]) -> torch.Tensor:
    """[len(sequences), V] logits after each sequence (all the same length: no padding needed)."""
    assert len({len(s) for s in sequences}) == 1
    with _one_thread():
        return model(torch.tensor(sequences)).logits[:, -1].float()


@torch.inference_mode()
def all_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] raw-model log-probabilities of the token after each position."""
    with _one_thread():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def _plain_probs(logits: torch.Tensor, prompt: list[int], prefixes: list[tuple], params) -> torch.Tensor:
    rows = [RowContext(params, prompt, list(p)) for p in prefixes]
    return logits_to_probs(apply_penalties_and_bias(logits, rows), [params] * len(rows))


def exact_prefix_probs(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, length: int
) -> dict[tuple, float]:
    """P(first `length` output tokens = s) under plain sampling, for every s in the support."""
    level: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(level)
        logits = last_logits(model, [prompt + list(p) for p in prefixes])
        probs = _plain_probs(logits, prompt, prefixes, params)
        nxt: dict[tuple, float] = {}
        for i, p in enumerate(prefixes):
            for t in torch.nonzero(probs[i] > 0).flatten().tolist():
                nxt[p + (t,)] = level[p] * float(probs[i, t])
        level = nxt
    return level


def filter_effect(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, length: int, **neutral
) -> float:
    """Probability mass of the prefixes (up to `length` - 1 tokens) at whose next position the
    processor set to its neutral value in `neutral` (e.g. top_p=1.0) changes the sampled
    distribution: shows the processor is really exercised by the test's parameters."""
    other = dataclasses.replace(params, **neutral)
    level: dict[tuple, float] = {(): 1.0}
    affected = 0.0
    for _ in range(length):
        prefixes = list(level)
        logits = last_logits(model, [prompt + list(p) for p in prefixes])
        probs = _plain_probs(logits, prompt, prefixes, params)
        alt = _plain_probs(logits, prompt, prefixes, other)
        changed = (probs - alt).abs().amax(dim=-1) > 1e-3
        affected += sum(level[p] for i, p in enumerate(prefixes) if changed[i])
        level = {
            p + (t,): level[p] * float(probs[i, t])
            for i, p in enumerate(prefixes)
            for t in torch.nonzero(probs[i] > 0).flatten().tolist()
        }
    return affected


def gof_p_value(samples: Iterable[tuple], probs: dict[tuple, float]) -> float:
    """Chi-square goodness of fit of sampled outcomes against exact probabilities.

    Outcomes outside the support fail outright (p = 0). Cells with expected count < 5 are merged
    into one cell so the chi-square approximation holds.
    """
    counts = Counter(samples)
    n = sum(counts.values())
    if any(s not in probs for s in counts):
        return 0.0
    cells = sorted(probs, key=lambda s: -probs[s])
    obs, exp, rare_obs, rare_exp = [], [], 0, 0.0
    for s in cells:
        e = probs[s] * n
        if e < 5:
            rare_obs, rare_exp = rare_obs + counts[s], rare_exp + e
        else:
            obs.append(counts[s])
            exp.append(e)
    if rare_exp > 0:
        obs.append(rare_obs)
        exp.append(rare_exp)
    if len(obs) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    return float(stats.chi2.sf(stat, len(obs) - 1))


def total_variation(samples: Iterable[tuple], probs: dict[tuple, float]) -> float:
    counts = Counter(samples)
    n = sum(counts.values())
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts[k] / n - probs.get(k, 0.0)) for k in keys)


def seeded(params: SamplingParams, n: int, base: int, **overrides) -> list[SamplingParams]:
    """n copies of `params` with distinct seeds base, base + 2, ... (even steps: the draft model's
    and Medusa's own streams are seeded with seed + an odd / even offset, so no request's draft
    stream ever equals another request's sampling stream within a run). Bases in the millions: the
    engine's keyed streams (random_streams.py) gave an outlying fit for seeds 0..5998 step 2, see the
    report of issue 18."""
    assert base % 2 == 0
    return [dataclasses.replace(params, seed=base + 2 * i, **overrides) for i in range(n)]
