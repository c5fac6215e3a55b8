"""Sampling pure functions: each knob does what it says."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.engine.sampler import (
    TOP_P_CANDIDATES,
    RowContext,
    _top_p_lowest_kept_by_selection,
    _top_p_lowest_kept_by_sort,
    apply_penalties_and_bias,
    compute_logprobs,
    draft_choices,
    logits_to_probs,
)
from specserve.engine.sampling_params import InvalidParameterError, SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def _probs(**kw) -> torch.Tensor:
    return logits_to_probs(LOGITS.clone(), [SamplingParams(**kw)])[0]


def test_greedy_is_one_hot_at_argmax():
    assert _probs(temperature=0).tolist() == [1, 0, 0, 0, 0]


def test_temperature_sharpens_and_flattens():
    assert _probs(temperature=0.5)[0] > 0.5 > _probs(temperature=2.0)[0]


def test_top_k_keeps_k_most_likely():
    p = _probs(top_k=2)
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert p.sum().item() == pytest.approx(1.0)
    assert p[0] / p[1] == pytest.approx(2.0)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    assert (_probs(top_p=0.7) > 0).tolist() == [True, True, False, False, False]  # 0.5 + 0.25 >= 0.7
    assert (_probs(top_p=0.5) > 0).tolist() == [True, False, False, False, False]


def test_min_p_drops_unlikely_tokens():
    assert (_probs(min_p=0.2) > 0).tolist() == [True, True, True, False, False]  # >= 0.1


def test_top_p_is_measured_after_top_k():
    """The issue's example: top-k first, then top-p on the renormalised survivors (.4/.7 >= .5)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = logits_to_probs(logits, [SamplingParams(top_k=2, top_p=0.5)])[0]
    assert (probs > 0).tolist() == [True, False, False, False]
    assert probs[0].item() == pytest.approx(1.0)


def test_min_p_is_relative_to_the_top_survivor_after_top_p():
    # top_p=.8 keeps {0, 1, 2} (the .03 + .07 below them is <= .2); min_p=.4 then compares against
    # the top survivor: .15 < .4 x .5 is dropped, .25 stays (renormalising by .9 changes neither).
    assert (_probs(top_p=0.8, min_p=0.4) > 0).tolist() == [True, True, False, False, False]


def test_ties_at_the_top_k_and_top_p_boundary_are_kept():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert (logits_to_probs(logits, [SamplingParams(top_k=2)])[0] > 0).tolist() == [True] * 4
    assert (logits_to_probs(logits, [SamplingParams(top_p=0.5)])[0] > 0).tolist() == [True] * 4


@pytest.mark.parametrize("off", [{"top_k": 0}, {"top_k": -1}, {"top_p": 1.0}, {"min_p": 0.0}, {"top_k": 5}])
def test_disabled_filters_keep_the_full_distribution(off):
    assert torch.allclose(_probs(**off), torch.softmax(LOGITS[0], dim=-1))


def _transformers_kept(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] bool: the tokens transformers' own warpers, in generate()'s order, leave in the running."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    warpers.append(MinPLogitsWarper(p.min_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits.unsqueeze(0))[0] > -math.inf


def test_kept_sets_match_transformers_logits_warpers():
    gen = torch.Generator().manual_seed(18)
    vocab, num_rows = 50, 400
    params = [
        SamplingParams(
            temperature=float(torch.empty(1).uniform_(0.2, 2.0, generator=gen)),
            top_k=int(torch.randint(-1, 12, (1,), generator=gen)),
            top_p=float(torch.empty(1).uniform_(0.05, 1.0, generator=gen)) if i % 4 else 1.0,
            min_p=float(torch.empty(1).uniform_(0.0, 0.5, generator=gen)) if i % 3 else 0.0,
        )
        for i in range(num_rows)
    ]
    # Peaked and flat rows alike: logit scales from 0.5 to 8.
    scale = torch.empty(num_rows, 1).uniform_(0.5, 8.0, generator=gen)
    logits = torch.randn(num_rows, vocab, generator=gen) * scale  # [N, V]
    probs = logits_to_probs(logits, params)  # [N, V], all rows in one batch
    for i, p in enumerate(params):
        assert torch.equal(probs[i] > 0, _transformers_kept(logits[i], p)), (i, p)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(num_rows))


def test_top_p_by_selection_keeps_what_the_whole_sort_keeps():
    """A vocabulary ten times the candidates, rows from peaked to flat: the rows the selection decides
    keep exactly the sort's set, and the rest (boundary beyond the candidates, or a mass at the
    limit) are left to the sort. Both kinds occur, so neither path is vacuous."""
    gen = torch.Generator().manual_seed(5)
    vocab, num_rows = 10 * TOP_P_CANDIDATES, 600
    scale = torch.empty(num_rows, 1).uniform_(0.5, 12.0, generator=gen)
    logits = torch.randn(num_rows, vocab, generator=gen) * scale  # [N, V]
    logits[:50, :3] = 40.0  # ties at the top
    logits[50:100, 100:] = -math.inf  # a top-k survivor set
    limit = torch.empty(num_rows).uniform_(0.0, 0.99, generator=gen)  # [N]: 1 - top_p
    limit[:20] = 0.0
    lowest_kept, decided = _top_p_lowest_kept_by_selection(logits, limit)
    by_sort = _top_p_lowest_kept_by_sort(logits, limit)
    assert torch.equal(lowest_kept[decided], by_sort[decided])
    assert 0.5 * num_rows < int(decided.sum()) < num_rows
    params = [SamplingParams(max_tokens=1, top_p=1.0 - float(x)) for x in limit]
    probs = logits_to_probs(logits.clone(), params)  # [N, V]
    assert torch.equal(probs > 0, logits >= by_sort.unsqueeze(1))


def test_top_p_at_the_edge_of_the_limit_is_left_to_the_sort():
    # Ten tokens of 0.1 each: top_p = 0.7 puts the limit (0.3) exactly on a mass, within any margin.
    logits = torch.zeros(1, 10)
    lowest_kept, decided = _top_p_lowest_kept_by_selection(logits, torch.tensor([0.3]))
    assert not bool(decided[0])
    assert (logits_to_probs(logits.clone(), [SamplingParams(max_tokens=1, top_p=0.7)])[0] > 0).all()


def test_greedy_rows_stay_one_hot_beside_filtered_rows():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.1, 0.6, 0.3]]))
    probs = logits_to_probs(logits, [SamplingParams(temperature=0, top_k=1), SamplingParams(top_k=2)])
    assert probs[0].tolist() == [0, 1, 0]
    assert (probs[1] > 0).tolist() == [False, True, True]


def test_logit_bias_and_penalties():
    row = RowContext(SamplingParams(logit_bias={4: 100.0}), [0], [])
    assert int(apply_penalties_and_bias(LOGITS, [row]).argmax()) == 4
    rep = RowContext(SamplingParams(repetition_penalty=2.0), [0], [])
    out = apply_penalties_and_bias(LOGITS, [rep])
    assert out[0, 0] == pytest.approx(LOGITS[0, 0] * 2.0)  # negative logit: multiplied
    freq = RowContext(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), [], [1, 1, 2])
    out = apply_penalties_and_bias(LOGITS, [freq])
    assert out[0, 1] == pytest.approx(LOGITS[0, 1] - 2.5)
    assert out[0, 2] == pytest.approx(LOGITS[0, 2] - 1.5)
    assert out[0, 0] == LOGITS[0, 0]


def test_seeded_draws_repeat():
    p = _probs(temperature=1.0)
    draws = [
        torch.multinomial(p, 20, replacement=True, generator=torch.Generator().manual_seed(9)).tolist()
        for _ in range(2)
    ]
    assert draws[0] == draws[1]


def test_logprobs_with_alternatives():
    ((lp, top),) = compute_logprobs(LOGITS, [1], 3)
    assert lp == pytest.approx(float(torch.log(torch.tensor(0.25))), abs=1e-6)
    assert [t for t, _ in top] == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"n": 1000}, "n"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
    ],
)
def test_invalid_parameters_name_themselves(kwargs, param):
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_draft_choices_give_greedy_rows_their_argmax_and_sampled_rows_their_distribution():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 40, generator=gen) * 3  # [5, V]
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=0.7, top_p=0.8),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=1.3, top_k=5),
        SamplingParams(max_tokens=1, temperature=0.0),
    ]
    argmax, dists = draft_choices(logits, params)
    assert argmax == logits.argmax(dim=-1).tolist()
    assert [d is None for d in dists] == [True, False, True, False, True]
    full = logits_to_probs(logits.clone(), params)  # [5, V]: what every row got before
    for i in (1, 3):
        assert torch.equal(dists[i], full[i])
    assert draft_choices(logits[:1], params[:1])[1] == [None]
