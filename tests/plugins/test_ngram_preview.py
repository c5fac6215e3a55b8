"""The n-gram proposer's free look ahead: the controller sees whether a request has a match and how
long it is before it decides k, and a broken preview costs only the controller's information."""

from __future__ import annotations

import logging

import numpy as np
from tiny_models import make_adaptive_llm, make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.spec_controller import Preview
from specserve.plugins.ngram import MAX_STRADDLING, TokenHistory, find_continuation, find_match

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_find_match_reports_the_matched_length():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3], dtype=np.int64)
    assert find_match(tokens, 1, 4, 2) == (3, [9, 9])  # "1 2 3" matched (4 tokens "3 1 2 3" are not)
    assert find_match(tokens, 1, 2, 5) == (2, [9, 9, 1, 2, 3])  # n is capped by ngram_max
    assert find_match(np.array([5, 6, 7], dtype=np.int64), 1, 4, 3) == (0, [])
    assert find_continuation(tokens, 1, 4, 2) == [9, 9]


def _reference_match(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> tuple[int, list[int]]:
    """The definition, by brute force: the longest n whose last n tokens occur earlier, latest first."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        for start in range(length - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[length - n :]:
                return n, tokens[start + n : start + n + k]
    return 0, []


def test_find_match_is_the_definition_even_where_bytes_match_across_tokens():
    rng = np.random.default_rng(1)
    for i in range(3000):
        tokens = rng.integers(0, 3 if i % 2 else 300, int(rng.integers(1, 120))).astype(np.int64)
        if i % 3 == 0:  # bytes that repeat across token boundaries (a search by bytes finds those too)
            tokens = (tokens * 257 + 1) << int(rng.integers(0, 40))
        for args in ((1, 4, 8), (2, 3, 5), (1, 1, 3)):
            assert find_match(tokens, *args) == _reference_match(tokens.tolist(), *args), (tokens, args)
    # The bytes of [1, 1] also occur one byte into tokens 2-4 (later than the real match at 0).
    straddling = np.array([1, 1, 0x100, 0x100, 0x100, 1, 1], dtype=np.int64)
    assert straddling.tobytes().rfind(straddling[-2:].tobytes(), 0, 6 * 8) == 17
    assert find_match(straddling, 2, 2, 3) == (2, [0x100, 0x100, 0x100])
    # One straddling match per token (a prompt built for it): past MAX_STRADDLING, compared by token.
    crafted = np.array([1, 1, 5] + [0x100] * 40 + [1, 1], dtype=np.int64)
    assert find_match(crafted, 2, 2, 2) == _reference_match(crafted.tolist(), 2, 2, 2) == (2, [5, 0x100])
    assert crafted.tobytes().count(crafted[-2:].tobytes()) > MAX_STRADDLING + 2
    no_aligned = np.array([0x100] * 40 + [1, 1], dtype=np.int64)
    assert find_match(no_aligned, 2, 2, 2) == _reference_match(no_aligned.tolist(), 2, 2, 2)


def test_token_history_is_the_request_tokens_as_they_grow_and_when_they_change():
    from specserve.engine.request import Request

    rng = np.random.default_rng(0)
    history = TokenHistory()
    req = Request("r", [int(t) for t in rng.integers(0, 50, 300)], SamplingParams(max_tokens=8))
    for step in range(200):  # outputs grow by 0-5 tokens a step, past the first capacities
        req.output_token_ids += [int(t) for t in rng.integers(0, 50, int(rng.integers(0, 6)))]
        got = history.tokens(req)
        assert got.dtype == np.int64 and got.tolist() == req.all_token_ids, step
    # Another request object under the same id, fewer tokens, a different last token: rebuilt.
    other = Request("r", req.prompt_token_ids[:10], SamplingParams(max_tokens=8))
    assert history.tokens(other).tolist() == other.all_token_ids
    req.output_token_ids = req.output_token_ids[:5]
    assert history.tokens(req).tolist() == req.all_token_ids
    req.output_token_ids = req.output_token_ids[:4] + [req.output_token_ids[4] + 1]
    assert history.tokens(req).tolist() == req.all_token_ids


def test_preview_is_what_propose_would_draft(tiny_llama_dir):
    llm = make_adaptive_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=4)
    proposer = llm.engine.proposer
    from specserve.engine.proposer import ProposalRequest
    from specserve.engine.request import Request

    for ids in ([1, 2, 3, 9, 1, 2, 3], [1, 2, 3, 4], [7, 7, 7, 7, 7, 7]):
        req = Request("r", ids[:-1], SamplingParams(max_tokens=8))
        req.output_token_ids = ids[-1:]
        seen = proposer.preview(req, 4)
        drafted = proposer.propose([ProposalRequest(req, 4)]).token_ids[0]
        assert seen == Preview(len(drafted), seen.hint, tuple(drafted), free=True)  # a lookup: free
        assert (seen.hint > 0) == bool(drafted)


def test_adaptive_ngram_learns_per_match_length_and_stays_lossless(tiny_llama_dir):
    prompts = mixed_prompts(16, seed=3)
    want = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_chat_template=False)]
    llm = make_adaptive_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=4)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)]
    assert got == want
    ctrl = llm.engine.controller
    initial = ctrl.acceptance.global_rates(hint=-1)  # a class nobody has seen
    learned = [h for h in range(1, 5) if ctrl.acceptance.global_rates(hint=h) != initial]
    assert learned, "no match-length class got verifications"
    assert ctrl.acceptance.global_rates(hint=None) == initial  # every n-gram proposal had its class


def test_a_broken_preview_costs_only_the_hint(tiny_llama_dir, caplog):
    prompts = mixed_prompts(8, seed=5)
    want = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_chat_template=False)]
    for broken, counted in (
        (lambda request, k: 1 / 0, "preview failed"),
        (lambda request, k: (k, 4), "invalid proposal"),  # not a Preview
    ):
        llm = make_adaptive_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=4)
        llm.engine.proposer.preview = broken
        with caplog.at_level(logging.ERROR, logger="specserve.engine"):
            outs = llm.generate(prompts, GREEDY, use_chat_template=False)
        assert [o.token_ids for o in outs] == want
        assert all(o.error is None for o in outs)
        assert llm.engine.stats.spec.proposer_errors > 0
        assert sum(counted in r.getMessage() for r in caplog.records) == 1  # logged once
        assert sum(o.spec.num_draft_tokens for o in outs) > 0  # it still drafts, without the hint
        caplog.clear()


def _find_match_by_windows(tokens: np.ndarray, ngram_min: int, ngram_max: int, k: int):
    """The straightforward definition: every window of every n compared with the suffix."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return n, tokens[start : start + k].tolist()
    return 0, []


def test_find_match_equals_comparing_every_window():
    rng = np.random.default_rng(0)
    for case in range(3000):
        length = int(rng.integers(1, 60))
        vocab = int(rng.integers(1, 6))  # small vocabularies: many partial and overlapping matches
        tokens = rng.integers(0, vocab, size=length).astype(np.int64)
        ngram_min = int(rng.integers(1, 4))
        ngram_max = ngram_min + int(rng.integers(0, 4))
        k = int(rng.integers(1, 8))
        expected = _find_match_by_windows(tokens, ngram_min, ngram_max, k)
        assert find_match(tokens, ngram_min, ngram_max, k) == expected, (case, tokens.tolist())
