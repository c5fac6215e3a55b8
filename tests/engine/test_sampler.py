"""Sampling pure functions: each knob does what it says."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.sampler import RowContext, apply_penalties_and_bias, compute_logprobs, logits_to_probs
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
