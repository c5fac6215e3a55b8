"""The verifier's greedy shortcut (argmax of the rows) against its full path (distributions, one-hot
greedy rows, the rejection sampler): the same tokens for every kind of window, in a batch that mixes
greedy and sampled windows."""

from __future__ import annotations

import random

import torch

from specserve.engine.random_streams import RequestRandom
from specserve.engine.request import Request
from specserve.engine.sampler import LOGIT_LIMIT
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.verifier import Window, _sample_windows, accept_greedy, verify_windows

VOCAB = 64


def _greedy_params(kind: str, rng: random.Random) -> SamplingParams:
    extra: dict[str, object] = {}
    if kind == "bias":
        extra["logit_bias"] = {rng.randrange(VOCAB): 8.0, rng.randrange(VOCAB): -8.0}
    elif kind == "repetition":
        extra["repetition_penalty"] = 3.0
    elif kind == "presence":
        extra["presence_penalty"] = 2.0
        extra["frequency_penalty"] = 1.0
    return SamplingParams(max_tokens=16, temperature=0.0, **extra)


def _batch(rng: random.Random, gen: torch.Generator) -> tuple[torch.Tensor, list[Window]]:
    """Windows of every kind with 0-4 drafts, each draft the row's argmax with chance 0.7 (so windows
    are accepted partly and wholly), and their logits [sum(k + 1), V]."""
    kinds = ["plain", "bias", "repetition", "presence", "grammar", "over_limit", "sampled"]
    windows, rows = [], []
    for i in range(12):
        kind = rng.choice(kinds)
        k = rng.randrange(5)
        logits = torch.randn(k + 1, VOCAB, generator=gen) * 3  # [k + 1, V]
        allowed = None
        if kind == "over_limit":
            # Two logits past the clamp in row 0: the clamp ties them, and the tie goes to the lower id.
            logits[0, 40], logits[0, 9] = 3 * LOGIT_LIMIT, 2 * LOGIT_LIMIT
        if kind == "grammar":
            allowed = torch.rand(k + 1, VOCAB, generator=gen) < 0.3  # [k + 1, V]
            allowed[:, rng.randrange(VOCAB)] = True
        drafts = []
        for j in range(k):
            best = int(logits[j].argmax())
            drafts.append(best if rng.random() < 0.7 else rng.randrange(VOCAB))
        if kind == "sampled":
            params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9)
            random_stream: RequestRandom | None = RequestRandom(rng.randrange(2**32))
        else:
            params = _greedy_params(kind, rng)
            random_stream = None
        request = Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(6)], params)
        request.output_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(4))]
        windows.append(Window(request, drafts, None, random_stream, allowed))
        rows.append(logits)
    return torch.cat(rows), windows


def test_greedy_shortcut_emits_what_the_full_path_emits():
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    differing_kinds = 0
    for _ in range(200):
        logits, windows = _batch(rng, gen)
        assert verify_windows(logits, windows) == _sample_windows(logits, windows)
        # The shortcut is not vacuous: without processing, a biased or penalised window's argmax
        # often differs from its processed one.
        raw = logits.argmax(dim=-1).tolist()
        row = 0
        for w in windows:
            n = len(w.draft_token_ids) + 1
            full = _sample_windows(logits[row : row + n], [w])[0]
            if w.request.params.greedy and accept_greedy(w.draft_token_ids, raw[row : row + n]) != full:
                differing_kinds += 1
            row += n
    assert differing_kinds > 50


def test_clamp_ties_break_as_in_the_full_path():
    logits = torch.zeros(2, VOCAB)
    logits[0, 40], logits[0, 9] = 3 * LOGIT_LIMIT, 2 * LOGIT_LIMIT  # both clamp to the limit: 9 wins
    logits[1] = -3 * LOGIT_LIMIT  # every logit clamps to -limit: token 0 wins, not the raw argmax
    logits[1, 33] = -2 * LOGIT_LIMIT
    params = SamplingParams(max_tokens=4, temperature=0.0)
    windows = [Window(Request(f"r{i}", [1, 2], params), [], None, None) for i in range(2)]
    assert verify_windows(logits, windows) == [[9], [0]] == _sample_windows(logits, windows)


def test_accept_greedy_keeps_drafts_up_to_the_first_miss():
    assert accept_greedy([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]
    assert accept_greedy([5, 6], [5, 6, 1]) == [5, 6, 1]  # all kept: the bonus token
    assert accept_greedy([], [4]) == [4]
