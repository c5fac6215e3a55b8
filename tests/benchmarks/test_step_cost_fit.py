"""`bench steps`' fit of decode step costs: measured and predicted lines per batch bucket."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.benchmarks.step_cost_fit import MIN_STEPS, bucket_label, fit_decode_costs


def _step(sequences, drafts, seconds, predicted, prefill=0):
    return SimpleNamespace(
        num_sequences=sequences,
        draft_tokens=drafts,
        prefill_tokens=prefill,
        step_seconds=seconds,
        predicted_seconds=predicted,
    )


def test_buckets_are_the_controllers():
    assert [bucket_label(n)[1] for n in (1, 2, 3, 4, 7, 8, 16, 31, 32)] == [
        "1", "2-3", "2-3", "4-7", "4-7", "8-15", "16-31", "16-31", "32-63",
    ]  # fmt: skip


def test_the_lines_are_recovered_and_only_decided_decode_steps_count():
    """Measured: 40 ms + 3 ms a sequence + 2 ms a draft row; predicted: draft rows at nothing (the
    error the fit is there to show). Prefill steps and steps without a prediction are left out."""
    steps = []
    for i in range(40):
        n, d = 16 + i % 16, (i * 7) % 20
        steps.append(_step(n, d, (40 + 3 * n + 2 * d) / 1e3, (40 + 3 * n) / 1e3))
    steps.append(_step(20, 0, 5.0, 5.0, prefill=900))  # a prefill step: far off every line
    steps.append(_step(20, 0, 5.0, None))  # speculation off: no decision
    (fit,) = fit_decode_costs(steps)
    assert fit["sequences"] == "16-31" and fit["steps"] == 40
    assert fit["drafting_steps"] == sum(1 for s in steps[:40] if s.draft_tokens)
    measured, predicted = fit["measured"], fit["predicted"]
    assert measured["base_ms"] == pytest.approx(40)
    assert measured["per_sequence_ms"] == pytest.approx(3)
    assert measured["per_draft_ms"] == pytest.approx(2)
    assert predicted["per_draft_ms"] == pytest.approx(0, abs=1e-9)


def test_a_column_that_does_not_vary_is_not_fitted_and_small_buckets_are_skipped():
    plain = [_step(8, 0, 0.1 + 0.001 * (i % 3), 0.1) for i in range(MIN_STEPS)]  # no draft rows at all
    few = [_step(1, 2, 0.05, 0.05) for _ in range(MIN_STEPS - 1)]
    (fit,) = fit_decode_costs(plain + few)
    assert fit["sequences"] == "8-15"
    assert fit["measured"]["per_draft_ms"] is None and fit["measured"]["per_sequence_ms"] is None
    assert fit["measured"]["base_ms"] == pytest.approx(101, abs=1)
