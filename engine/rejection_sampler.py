"""Speculative verification: keep exactly the tokens the target would have produced.

Terms (as vLLM): for a request with drafts d_1..d_k and target distributions p_0..p_k (p_i is the
target's distribution for the token after d_i, p_0 after the last committed token):
  * accepted  - d_i is kept with probability min(1, p_{i-1}(d_i) / q_i(d_i)); stop at the first rejection
  * recovered - on rejection at i, one token is drawn from norm(max(0, p_{i-1} - q_i))
  * bonus     - if all k drafts are accepted, one extra token is drawn from p_k
So every step emits accepted + 1 tokens, and the emitted sequence is distributed exactly as if it had
been sampled from the target token by token (Leviathan et al. 2023, Chen et al. 2023).
Greedy rows have one-hot p, which reduces this to "accept while d_i == argmax p_{i-1}".
n-gram drafts have no q: they are treated as one-hot q (accept with probability p(d_i)).
Randomness comes from the request's keyed streams (random_streams.py), one value per output position
and purpose, never from a shared generator's draw order. A one-hot (certain) draft is judged by drawing
the target's own token first and accepting iff it equals the draft: the same law, and the emitted token
is then exactly the one plain decoding draws at that position.
"""

from __future__ import annotations

import torch

from .random_streams import Purpose, RequestRandom


def draft_token_acceptance_probs(
    target_probs: torch.Tensor,  # [D, V] target distribution at each draft position (p_{i-1})
    draft_token_ids: torch.Tensor,  # [D]
    draft_probs: torch.Tensor | None,  # [D, V] or None for one-hot drafts
) -> torch.Tensor:  # [D] min(1, p(d) / q(d))
    rows = torch.arange(draft_token_ids.numel())
    p = target_probs[rows, draft_token_ids]
    if draft_probs is None:
        return p.clamp(max=1.0)
    q = draft_probs[rows, draft_token_ids]
    # q(d) > 0 whenever d was drawn from q; guard against a proposer that reports 0 anyway.
    return torch.where(q > 0, (p / q.clamp(min=1e-30)).clamp(max=1.0), (p > 0).float())


def recovered_distribution(
    target_probs: torch.Tensor,  # [V]
    draft_probs: torch.Tensor | None,  # [V] or None (one-hot at draft_token)
    draft_token: int,
) -> torch.Tensor:  # [V] norm(max(0, p - q)), falling back to p when that is all zero
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp(min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else target_probs


def rejection_sample(
    target_probs: torch.Tensor,  # [sum(k_r + 1), V] per request: p_0..p_k flattened
    draft_token_ids: torch.Tensor,  # [sum(k_r)]
    draft_probs: torch.Tensor | None,  # [sum(k_r), V] or None
    num_draft_tokens: list[int],  # k_r per request
    is_greedy: list[bool],
    streams: list[RequestRandom | None],  # per request; None only for greedy requests
    start_positions: list[int],  # per request: output position of p_0 (tokens already generated)
    cut_drafts: list[tuple[int, torch.Tensor] | None] | None = None,  # per request: (d, q [V]) or None
) -> list[list[int]]:
    """Emitted tokens per request: accepted drafts followed by one recovered or bonus token.

    Randomness is keyed by output position (random_streams.py): with p0 = start_positions[r], draft
    i is judged at position p0 + i and the recovered or bonus token is drawn at its own position, so
    what decides position p depends on how p is decided, never on how many draws came before.

    `cut_drafts[r]` = (d, q): the request's drafts were cut before d, a draft drawn from q that the
    target gives probability 0 (a grammar forbids it). Had d been verified it would have been rejected
    for certain and the token drawn from norm(max(0, p - q)); so after the kept drafts that residual
    replaces the bonus draw. Drawing from p there instead would bias the output towards the tokens q
    favours (q's mass on d is what the residual gives back to them)."""
    target_rows = torch.tensor([0] + num_draft_tokens).add(1).cumsum(0) - 1  # start row of each request
    draft_starts = [0]
    for k in num_draft_tokens:
        draft_starts.append(draft_starts[-1] + k)
    # Rows of target_probs that score each draft: p_{i-1} for d_i.
    draft_rows = torch.cat(
        [torch.arange(int(target_rows[r]), int(target_rows[r]) + k) for r, k in enumerate(num_draft_tokens)]
        or [torch.zeros(0, dtype=torch.long)]
    )
    accept_probs = draft_token_acceptance_probs(target_probs[draft_rows], draft_token_ids, draft_probs)  # [D]
    # A draft is certain when its q is one-hot at it (n-gram, argmax, or q(d) = 1): see below.
    if draft_probs is None:
        certain = [True] * draft_token_ids.numel()
    else:
        certain = (draft_probs[torch.arange(draft_token_ids.numel()), draft_token_ids] >= 1.0).tolist()
    emitted: list[list[int]] = []
    for r, k in enumerate(num_draft_tokens):
        start, d0 = int(target_rows[r]), draft_starts[r]
        drafts = draft_token_ids[d0 : d0 + k].tolist()
        if is_greedy[r]:
            targets = target_probs[start : start + k + 1].argmax(dim=-1).tolist()
            out: list[int] = []
            for i, d in enumerate(drafts):
                if d != targets[i]:
                    break
                out.append(d)
            out.append(targets[len(out)])  # recovered (the target's own choice) or bonus
            emitted.append(out)
            continue
        rng, p0 = streams[r], start_positions[r]
        if rng is None:
            raise ValueError("a sampled request needs its random stream")
        out = []
        for i, d in enumerate(drafts):
            if certain[d0 + i]:
                # Certain draft (q(d) = 1): draw the target's own token t ~ p_{i-1} with SAMPLE first
                # and accept iff t == d, else emit t. Same law as the rule below: P(accept) = p(d) =
                # min(1, p(d) / q(d)), and t given t != d is norm(p with d removed), the recovered
                # distribution. But t is exactly what plain decoding draws at this position, so
                # certain drafts never change a seeded request's text.
                token = rng.sample(target_probs[start + i], p0 + i, Purpose.SAMPLE)
                out.append(token)
                if token != d:
                    break
            elif rng.uniform(p0 + i, Purpose.ACCEPT) < float(accept_probs[d0 + i]):
                out.append(d)  # accepted
            else:
                q = draft_probs[d0 + i] if draft_probs is not None else None
                recovered = recovered_distribution(target_probs[start + i], q, d)  # [V]
                out.append(rng.sample(recovered, p0 + i, Purpose.SAMPLE))
                break
        else:
            final = target_probs[start + k]  # bonus (k = 0: plain)
            cut = cut_drafts[r] if cut_drafts else None
            if cut is not None:
                final = recovered_distribution(final, cut[1], cut[0])
            out.append(rng.sample(final, p0 + k, Purpose.SAMPLE))
        emitted.append(out)
    return emitted
