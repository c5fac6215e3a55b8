"""Score draft windows: target logits -> processed target distributions -> emitted tokens.

For a request with drafts d_1..d_k, the target ran over [last, d_1..d_k] and returned k+1 logit rows.
Row i is processed (bias, penalties, temperature, top-k/p, min-p) with d_1..d_i counted as output
tokens, exactly as plain decoding would have processed it had it produced d_1..d_i itself.

Structured output: a constrained request brings one grammar mask per row (the grammar state after
d_1..d_i); forbidden tokens get -inf after the penalties, so every row is the constrained target's
distribution, the same one plain constrained decoding samples from. Its drafts were cut before the
first token the grammar forbids (engine/grammar.py); when that token came with a q, the cut position
is decided as its rejection would have been (see rejection_sample's `cut_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .random_streams import RequestRandom
from .rejection_sampler import rejection_sample
from .request import Request
from .sampler import RowContext, apply_penalties_and_bias, logits_to_probs


@dataclass
class Window:
    request: Request
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None  # [k, V] or None (one-hot drafts)
    random: RequestRandom | None  # the request's keyed streams (None only for greedy requests)
    allowed: torch.Tensor | None = None  # [k + 1, V] bool grammar mask per row, or None (unconstrained)
    # The first draft the grammar forbade and its q row [V], when drafts were cut there (see above).
    cut_draft: tuple[int, torch.Tensor] | None = None


def verify_windows(logits: torch.Tensor, windows: list[Window]) -> list[list[int]]:
    """logits: [sum(k_r + 1), V] float32 in window order. Returns emitted tokens per window."""
    vocab = logits.shape[-1]
    rows: list[RowContext] = []
    for w in windows:
        base = w.request.output_token_ids
        for i in range(len(w.draft_token_ids) + 1):
            rows.append(
                RowContext(w.request.params, w.request.prompt_token_ids, base + w.draft_token_ids[:i])
            )
    processed = apply_penalties_and_bias(logits, rows)
    _apply_grammar_masks(processed, windows)
    probs = logits_to_probs(processed, [r.params for r in rows])  # [N, V]
    draft_ids = torch.tensor([t for w in windows for t in w.draft_token_ids], dtype=torch.long)
    any_probs = any(w.draft_probs is not None for w in windows)
    draft_probs = None
    if any_probs:
        parts = []
        for w in windows:
            k = len(w.draft_token_ids)
            if not k:
                continue
            if w.draft_probs is None:
                parts.append(torch.nn.functional.one_hot(torch.tensor(w.draft_token_ids), vocab).float())
            else:
                parts.append(_fit_vocab(w.draft_probs.float(), vocab))
        draft_probs = torch.cat(parts) if parts else None
    return rejection_sample(
        probs,
        draft_ids,
        draft_probs,
        [len(w.draft_token_ids) for w in windows],
        [w.request.params.greedy for w in windows],
        [w.random for w in windows],
        # The window's first token lands at output position len(output) (the drafts follow it).
        [len(w.request.output_token_ids) for w in windows],
        cut_drafts=[
            (w.cut_draft[0], _fit_vocab(w.cut_draft[1].float().unsqueeze(0), vocab)[0])
            if w.cut_draft
            else None
            for w in windows
        ],
    )


def _apply_grammar_masks(processed: torch.Tensor, windows: list[Window]) -> None:
    """processed: [N, V] (in place). Forbidden tokens -> -inf, after the penalties' clamp to finite."""
    row = 0
    for w in windows:
        n = len(w.draft_token_ids) + 1
        if w.allowed is not None:
            processed[row : row + n].masked_fill_(~w.allowed[:, : processed.shape[-1]], float("-inf"))
        row += n


def _fit_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Pad or cut a draft distribution to the target's vocabulary (padding rows differ between models)."""
    if probs.shape[-1] == vocab:
        return probs
    if probs.shape[-1] > vocab:
        cut = probs[:, :vocab]
        return cut / cut.sum(-1, keepdim=True).clamp(min=1e-30)
    return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
