"""Check one request's proposal before it reaches the target: a proposer is untrusted code.

A draft id outside the vocabulary would fail the whole batch forward, a q of the wrong shape the whole
verification, and a q that is not a probability distribution would silently break exactness. Each is
caught here, per request, so a bad proposal only costs that request its drafts for this step.
"""

from __future__ import annotations

import torch

# Rows of q must sum to 1; float32 softmax over 150k entries is off by ~1e-6, bf16 by ~1e-3.
PROB_SUM_TOLERANCE = 1e-2


def check_proposal(token_ids: list[int], probs: torch.Tensor | None, vocab_size: int) -> str | None:
    """None when the proposal is usable, else why not (one short phrase).

    token_ids: the drafts (already cut to the request's k); probs: [len(token_ids), V'] or None, where
    V' may differ from vocab_size (padding rows of a draft model's embedding; the verifier fits it)."""
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        return f"draft token id outside the vocabulary [0, {vocab_size})"
    if probs is None:
        return None
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[0] < len(token_ids):
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        return f"draft probs of shape {shape}, expected [{len(token_ids)}, vocab]"
    q = probs[: len(token_ids)].float()
    if q.shape[-1] < max(token_ids, default=-1) + 1:
        return "draft probs narrower than the draft token ids"
    if not torch.isfinite(q).all():
        return "draft probs are not finite"
    if (q < 0).any():
        return "draft probs are negative"
    sums = q.sum(-1)  # [k]
    if ((sums - 1).abs() > PROB_SUM_TOLERANCE).any():
        return f"draft probs do not sum to 1 (row sums {sums.min():.4g}..{sums.max():.4g})"
    return None
