"""Turn logits into the distribution each request samples from: pure functions over [rows, vocab].

Order: logit bias -> repetition / presence / frequency penalties -> temperature -> top-k -> top-p ->
min-p, the order transformers' `generate` applies its warpers in. Each filter sees what the previous
one left: top-p measures mass on the renormalised top-k survivors (p = [.4, .3, .2, .1], top_k=2,
top_p=.5 keeps only token 0) and min-p compares against the most likely survivor. vLLM runs min-p
before top-k/top-p; the kept sets agree except where top-p and min-p are combined. Speculative
verification and the draft proposers call the same functions for every position of a window, with
penalties counted over the tokens accepted so far in that window, so the distribution it verifies
against is exactly the one plain decoding would sample from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

LOGIT_LIMIT = 1e4  # far beyond any real logit; divided by the smallest temperature (1e-5) still finite


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
    return logits.clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


def logits_to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] processed logits -> [N, V] probabilities after temperature, top-k, top-p, min-p.

    Greedy rows become one-hot at their argmax so that verification treats them uniformly. Each
    filter is applied only to the rows that enable it and always keeps the most likely token.
    """
    scores = logits.float() / _temperatures(params).unsqueeze(1)  # [N, V]
    scores = _apply_top_k(scores, params)
    scores = _apply_top_p(scores, params)
    scores = _apply_min_p(scores, params)
    probs = torch.softmax(scores, dim=-1)  # [N, V]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, dtype=torch.long)
        probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(dim=-1), logits.shape[-1]).float()
    return probs


def draft_choices(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """A proposer's rows: [N, V] logits -> (each row's argmax, each row's distribution or None).

    A greedy request drafts the argmax and needs no distribution (its drafts are one-hot); only the
    sampled rows go through `logits_to_probs` (a softmax and one-hot row over 152k tokens cost a
    Qwen draft step 0.7 ms of its 27 at batch 1 on the 2-core EPYC VM)."""
    argmax = logits.argmax(dim=-1).tolist()  # [N]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    dists: list[torch.Tensor | None] = [None] * len(params)
    if sampled:
        rows = logits if len(sampled) == len(params) else logits[torch.tensor(sampled, dtype=torch.long)]
        for i, row in zip(sampled, logits_to_probs(rows, [params[i] for i in sampled]), strict=True):
            dists[i] = row
    return argmax, dists


def _temperatures(params: list[SamplingParams]) -> torch.Tensor:
    """[N] divisor per row; greedy rows keep 1.0 (they are replaced by a one-hot row anyway)."""
    return torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)


def _rows_where(params: list[SamplingParams], enabled: Callable[[SamplingParams], bool]) -> torch.Tensor:
    """Indices of the sampled (non-greedy) rows for which a filter is enabled."""
    return torch.tensor([i for i, p in enumerate(params) if not p.greedy and enabled(p)], dtype=torch.long)


def _apply_top_k(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep the k highest scores per row; ties with the k-th score are kept too (as transformers).
    The k-th score comes from a partial selection (topk), not a sort of the vocabulary: the same
    value, at 0.1 ms a row where the sort took 2 ms (SmolLM2's 49k vocabulary, 2-core EPYC VM)."""
    vocab = scores.shape[-1]
    rows = _rows_where(params, lambda p: 0 < p.top_k < vocab)
    if not rows.numel():
        return scores
    sub = scores[rows]  # [R, V]
    k = torch.tensor([params[i].top_k for i in rows.tolist()], dtype=torch.long)  # [R]
    kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    scores[rows] = sub.masked_fill(sub < kth, -math.inf)
    return scores


def _apply_top_p(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose renormalised mass reaches top_p.

    Decided as transformers' TopPLogitsWarper does (ascending sort, drop tokens while the mass below
    them is <= 1 - top_p) so the float32 boundary decisions are the same; tokens tied with the
    least likely kept token are kept as well, so the set never depends on the sort's tie order.
    Most rows are decided from their most likely tokens alone (`_top_p_lowest_kept_by_selection`);
    the rest by that sort."""
    rows = _rows_where(params, lambda p: p.top_p < 1.0)
    if not rows.numel():
        return scores
    sub = scores[rows]  # [R, V]
    limit = torch.tensor([1.0 - params[i].top_p for i in rows.tolist()], dtype=torch.float32)  # [R]
    lowest_kept, decided = _top_p_lowest_kept_by_selection(sub, limit)  # [R], [R]
    undecided = (~decided).nonzero().flatten()
    if undecided.numel():
        lowest_kept[undecided] = _top_p_lowest_kept_by_sort(sub[undecided], limit[undecided])
    scores[rows] = sub.masked_fill(sub < lowest_kept.unsqueeze(1), -math.inf)
    return scores


def _top_p_lowest_kept_by_sort(sub: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """sub: [R, V] scores, limit: [R] 1 - top_p. [R]: the least likely kept token's score, from the
    whole row sorted ascending (transformers' computation, step for step)."""
    sorted_scores = sub.sort(dim=-1).values  # [R, V] ascending
    mass_up_to = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    num_dropped = (mass_up_to <= limit.unsqueeze(1)).sum(dim=-1, keepdim=True)  # [R, 1]
    # The most likely token always stays (also when top_p rounds to 0 in float32).
    num_dropped = num_dropped.clamp_(max=sub.shape[-1] - 1)
    return sorted_scores.gather(1, num_dropped).squeeze(1)


# Most likely tokens a row's top-p boundary is first looked for among. A language model's top 0.9-0.95
# is usually a few to a few hundred tokens; a row whose boundary lies further down is sorted whole.
TOP_P_CANDIDATES = 512
# How far the masses beside the boundary must be from 1 - top_p, relative to it, for the selection's
# decision to stand. The sort's masses come from a softmax of the sorted row, whose normaliser is summed
# in another order than the unsorted row's, so every probability of a row differs by one factor: by up
# to 1.6e-6 at SmolLM2's 49k vocabulary and 6.8e-6 at Qwen's 152k (measured on random rows). A mass
# closer to the limit than that could be decided either way.
TOP_P_MARGIN = 3e-5


def _top_p_lowest_kept_by_selection(
    sub: torch.Tensor, limit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sub: [R, V] scores, limit: [R]. ([R] least likely kept score, [R] bool decided).

    The sort's "mass up to and including a token" is the float32 rounding of a sum accumulated in
    float64 (torch's CPU cumsum), and for the token of rank j (0 = most likely) it equals the row's
    total mass less the mass of the j tokens above it, which needs only those j: a top-k selection
    of the row, not a sort of its whole vocabulary (2.3 ms a row for SmolLM2's 49k on the 2-core EPYC
    VM, more than a draft row's forward). A row is decided here when its boundary falls among its
    TOP_P_CANDIDATES most likely tokens with the masses beside it clear of the limit (TOP_P_MARGIN)."""
    num_rows, vocab = sub.shape
    candidates = min(vocab, TOP_P_CANDIDATES)
    probs = sub.softmax(dim=-1)  # [R, V]
    total = probs.sum(dim=-1, dtype=torch.float64)  # [R]
    top_probs, top_ids = probs.topk(candidates, dim=-1)  # [R, C] descending
    above = top_probs.double().cumsum(dim=-1)  # [R, C]: mass of ranks 0..j
    # mass_up_to[:, j] = mass of ranks >= j = total - mass of ranks < j.  [R, C + 1]
    above_before = torch.cat([torch.zeros(num_rows, 1, dtype=torch.float64), above], dim=1)
    mass_up_to = (total.unsqueeze(1) - above_before).clamp_(min=0.0)
    limit64 = limit.double().unsqueeze(1)  # [R, 1]
    kept = (mass_up_to[:, :candidates].float() > limit.unsqueeze(1)).sum(dim=-1)  # [R]
    # Rank `candidates` is dropped when its mass is within the limit, so every kept token is a candidate.
    boundary_seen = mass_up_to[:, candidates].float() <= limit
    num_kept = kept.clamp(min=1)  # the most likely token always stays
    rows = torch.arange(num_rows)
    last_kept = mass_up_to[rows, num_kept - 1]  # [R]
    first_dropped = mass_up_to[rows, num_kept]  # [R]
    margin = TOP_P_MARGIN * limit64[:, 0]  # [R]
    clear = ((last_kept - limit64[:, 0]).abs() > margin) & ((first_dropped - limit64[:, 0]).abs() > margin)
    # kept == 0 (top_p rounds to 0): the top token alone, whatever the masses say.
    decided = boundary_seen & (clear | (kept == 0))
    lowest_kept = sub.gather(1, top_ids[rows, num_kept - 1].unsqueeze(1)).squeeze(1)  # [R]
    return lowest_kept, decided


def _apply_min_p(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens below min_p x the probability of the most likely token still in the running."""
    rows = _rows_where(params, lambda p: p.min_p > 0)
    if not rows.numel():
        return scores
    sub = scores[rows]  # [R, V]
    probs = sub.softmax(dim=-1)  # [R, V]
    min_p = torch.tensor([params[i].min_p for i in rows.tolist()], dtype=torch.float32)  # [R]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    # The argmax compares its own probability against at most itself, so it is never dropped.
    scores[rows] = sub.masked_fill(probs < threshold, -math.inf)
    return scores


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
