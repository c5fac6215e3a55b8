"""Rejection sampler: greedy cases by hand, determinism, and the emitted distribution equals the target's."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.random_streams import RequestRandom
from specserve.engine.rejection_sampler import rejection_sample


def _onehot(ids: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


@pytest.mark.parametrize(
    ("target_argmax", "drafts", "expected"),
    [
        ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),  # all accepted + bonus
        ([5, 2, 3, 4], [1, 2, 3], [5]),  # first rejected -> recovered only
        ([1, 2, 6, 4], [1, 2, 3], [1, 2, 6]),  # middle rejected
        ([7], [], [7]),  # no drafts: plain decoding
    ],
)
def test_greedy_cases(target_argmax, drafts, expected):
    probs = _onehot(target_argmax)
    out = rejection_sample(
        probs, torch.tensor(drafts, dtype=torch.long), None, [len(drafts)], [True], [None], [0]
    )
    assert out == [expected]


def test_greedy_batch_mixes_requests():
    probs = torch.cat([_onehot([1, 2, 3]), _onehot([4]), _onehot([5, 0])])
    drafts = torch.tensor([1, 9 % 8, 5], dtype=torch.long)
    out = rejection_sample(probs, drafts, None, [2, 0, 1], [True, True, True], [None] * 3, [0] * 3)
    assert out == [[1, 2], [4], [5, 0]]


def _random_case(seed: int, vocab: int = 6, k: int = 3):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    return p, q


def test_seeded_determinism():
    p, q = _random_case(0)
    drafts = torch.tensor([0, 1, 2])
    runs = [rejection_sample(p, drafts, q, [3], [False], [RequestRandom(42)], [5]) for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_first_emitted_token_follows_target_distribution(with_draft_probs):
    """Draw the draft from q (or a fixed n-gram-style guess), verify, and histogram the first emitted token.

    Whatever the draft, the first emitted token must be distributed as p_0 (total variation < 0.01).
    """
    vocab, n = 6, 80_000
    p, q = _random_case(1, vocab, k=1)
    gen = torch.Generator().manual_seed(7)
    if with_draft_probs:
        drafts = torch.multinomial(q[0], n, replacement=True, generator=gen)  # [n]
    else:
        drafts = torch.full((n,), int(torch.argmax(q[0])))
    # Vectorised over many independent one-draft requests: same pure functions, batched.
    target = p[:2].repeat(n, 1)  # [2n, V]
    out = rejection_sample(
        target,
        drafts,
        q[:1].repeat(n, 1) if with_draft_probs else None,
        [1] * n,
        [False] * n,
        [RequestRandom(i) for i in range(n)],  # independent requests: one seed each
        [0] * n,
    )
    first = torch.tensor([o[0] for o in out])
    freq = torch.bincount(first, minlength=vocab).float() / n
    tv = 0.5 * (freq - p[0]).abs().sum().item()
    assert tv < 0.01, (freq, p[0])


def test_two_token_sequences_follow_target():
    """With 2 drafts, the joint law of the first two emitted tokens is p_0 x p_1 (independent p here)."""
    vocab, n = 4, 80_000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=g), dim=-1)
    gen = torch.Generator().manual_seed(11)
    d1 = torch.multinomial(q[0], n, replacement=True, generator=gen)
    d2 = torch.multinomial(q[1], n, replacement=True, generator=gen)
    drafts = torch.stack([d1, d2], 1).reshape(-1)
    streams = [RequestRandom(i) for i in range(n)]
    out = rejection_sample(p.repeat(n, 1), drafts, q.repeat(n, 1), [2] * n, [False] * n, streams, [0] * n)
    pairs = torch.tensor([o[0] * vocab + o[1] for o in out if len(o) >= 2])
    # Every emitted sequence has >= 1 token; only those with a second token say something about p_1.
    # Condition on the first token: P(second | first) must be p_1 whatever the first was.
    joint = torch.bincount(pairs, minlength=vocab * vocab).float().view(vocab, vocab)
    cond = joint / joint.sum(1, keepdim=True)
    tv = 0.5 * (cond - p[1]).abs().sum(1)
    assert (tv < 0.02).all(), tv
