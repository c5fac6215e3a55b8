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
from .sampler import LOGIT_LIMIT, RowContext, apply_penalties_and_bias, logits_to_probs


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
    """logits: [sum(k_r + 1), V] float32 in window order. Returns emitted tokens per window.

    Greedy windows are decided from the argmax of their rows (see `_greedy_targets`); the others go
    through the full distribution and the rejection sampler."""
    starts = [0]
    for w in windows:
        starts.append(starts[-1] + len(w.draft_token_ids) + 1)
    emitted: list[list[int]] = [[] for _ in windows]
    greedy = [i for i, w in enumerate(windows) if w.request.params.greedy]
    sampled = [i for i, w in enumerate(windows) if not w.request.params.greedy]
    if greedy:
        targets = _greedy_targets(logits, [windows[i] for i in greedy], [starts[i] for i in greedy])
        for i, window_targets in zip(greedy, targets, strict=True):
            emitted[i] = accept_greedy(windows[i].draft_token_ids, window_targets)
    if sampled:
        if len(sampled) < len(windows):
            logits = torch.cat([logits[starts[i] : starts[i + 1]] for i in sampled])
        for i, out in zip(sampled, _sample_windows(logits, [windows[i] for i in sampled]), strict=True):
            emitted[i] = out
    return emitted


def accept_greedy(draft_token_ids: list[int], targets: list[int]) -> list[int]:
    """targets: the target's argmax at each of the k + 1 rows. Drafts are kept while they equal it,
    then the target's own token follows (recovered, or the bonus when all k were kept)."""
    out: list[int] = []
    for d, t in zip(draft_token_ids, targets, strict=False):
        if d != t:
            break
        out.append(d)
    out.append(targets[len(out)])
    return out


def _greedy_targets(logits: torch.Tensor, windows: list[Window], starts: list[int]) -> list[list[int]]:
    """The argmax of every row of each greedy window's processed logits. The same tokens the full path
    gives (its one-hot rows are put at that argmax), without it: the clone, softmax and one-hot over
    [N, V] cost 0.23-0.41 ms a row of SmolLM2's 49k vocabulary on the 2-core EPYC VM, a fifth of what
    a draft row's forward costs. A window whose rows need processing (bias, penalties, a grammar
    mask) is processed on its rows alone; the rest are argmaxed as they came, which is their
    processed argmax: processing them would only clamp to +-LOGIT_LIMIT, and a row whose largest
    logit is beyond it either way (never seen: real logits are below 100) is processed too, so that
    ties after the clamp break as they do there."""
    plain = [j for j, w in enumerate(windows) if not _needs_processing(w)]
    unprocessed = set(plain)
    out: list[list[int]] = [[] for _ in windows]
    if plain:
        rows = [r for j in plain for r in range(starts[j], starts[j] + len(windows[j].draft_token_ids) + 1)]
        sub = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, dtype=torch.long)]
        values, argmax = sub.max(dim=-1)  # [R], [R]: one pass over the rows
        # A row whose largest logit is beyond the clamp, either way, has ties after it.
        over = (values.abs() >= LOGIT_LIMIT).tolist()
        ids = argmax.tolist()
        row = 0
        for j in plain:
            n = len(windows[j].draft_token_ids) + 1
            if any(over[row : row + n]):
                out[j] = _processed_argmax(logits[starts[j] : starts[j] + n], windows[j])
            else:
                out[j] = ids[row : row + n]
            row += n
    for j, w in enumerate(windows):
        if j not in unprocessed:
            out[j] = _processed_argmax(logits[starts[j] : starts[j] + len(w.draft_token_ids) + 1], w)
    return out


def _needs_processing(w: Window) -> bool:
    """Whether anything but the clamp changes this greedy window's logits."""
    p = w.request.params
    return (
        w.allowed is not None
        or bool(p.logit_bias)
        or p.repetition_penalty != 1.0
        or bool(p.presence_penalty)
        or bool(p.frequency_penalty)
    )


def _processed_argmax(logits: torch.Tensor, w: Window) -> list[int]:
    """logits: [k + 1, V] of one window. The argmax of each row after bias, penalties and grammar."""
    processed = apply_penalties_and_bias(logits, _row_contexts(w))
    _apply_grammar_masks(processed, [w])
    return processed.argmax(dim=-1).tolist()


def _row_contexts(w: Window) -> list[RowContext]:
    """Row i of a window is conditioned on the output so far plus d_1..d_i."""
    base = w.request.output_token_ids
    return [
        RowContext(w.request.params, w.request.prompt_token_ids, base + w.draft_token_ids[:i])
        for i in range(len(w.draft_token_ids) + 1)
    ]


def _sample_windows(logits: torch.Tensor, windows: list[Window]) -> list[list[int]]:
    """logits: [sum(k_r + 1), V] of these windows. The full path: processed target distributions and
    the rejection sampler."""
    vocab = logits.shape[-1]
    rows = [row for w in windows for row in _row_contexts(w)]
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
