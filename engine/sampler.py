"""Turn logits into the distribution each request samples from: pure functions over [rows, vocab].

Order (as vLLM): logit bias -> repetition / presence / frequency penalties -> temperature ->
min-p -> top-k -> top-p. Speculative verification calls the same functions for every position of a
window, with penalties counted over the tokens accepted so far in that window, so the distribution
it verifies against is exactly the one plain decoding would sample from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

_LOGIT_LIMIT = 1e4  # far beyond any real logit; divided by the smallest temperature (1e-5) still finite


@dataclass
class RowContext:
    """What one row of logits is conditioned on."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, including draft tokens assumed accepted


def apply_penalties_and_bias(logits: torch.Tensor, rows: list[RowContext]) -> torch.Tensor:
    """logits: [N, V] float32 (modified copy returned)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor([int(t) for t in p.logit_bias], dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
            )
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=vocab)
            counts = counts[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    # Keep logits finite: a tiny repetition_penalty divides a logit to inf, and softmax([inf, ...]) is NaN.
    return logits.clamp_(-_LOGIT_LIMIT, _LOGIT_LIMIT)


def logits_to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] processed logits -> [N, V] probabilities after temperature, min-p, top-k, top-p.

    Greedy rows become one-hot at their argmax so that verification treats them uniformly.
    """
    n, vocab = logits.shape
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)  # [N, V]
    for i, p in enumerate(params):
        if p.greedy:
            row = torch.zeros(vocab)
            row[int(torch.argmax(logits[i]))] = 1.0
            probs[i] = row
            continue
        row = probs[i]
        keep = torch.ones(vocab, dtype=torch.bool)
        if p.min_p > 0:
            keep &= row >= p.min_p * row.max()
        if p.top_k > 0 and p.top_k < vocab:
            kth = torch.topk(row, p.top_k).values[-1]
            keep &= row >= kth
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(row, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            cum_before = torch.cumsum(sorted_probs, 0) - sorted_probs
            sorted_keep = cum_before < p.top_p
            sorted_keep[0] = True  # also when top_p rounds to 0 in float32
            top_p_keep = torch.zeros(vocab, dtype=torch.bool)
            top_p_keep[order] = sorted_keep
            keep &= top_p_keep
        row = torch.where(keep, row, torch.zeros_like(row))
        probs[i] = row / row.sum()
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution with the request's own generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw-model log-probabilities of the chosen tokens, plus the `num_top` most likely alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    out = []
    for i, tok in enumerate(token_ids):
        top: list[tuple[int, float]] = []
        if num_top:
            vals, ids = torch.topk(logp[i], num_top)
            top = list(zip(ids.tolist(), vals.tolist(), strict=True))
        out.append((float(logp[i, tok]), top))
    return out
