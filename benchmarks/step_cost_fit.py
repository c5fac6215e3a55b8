"""What a decode step costs, per batch size: a least-squares line over a step log's decode steps,
measured and as the speculation controller predicted them (`bench steps`).

Per batch bucket (1, 2-3, 4-7, ... sequences, the controller's own buckets), step seconds are fitted as
base + a x sequences + b x draft tokens, once on the measured seconds and once on the controller's
predictions of the same steps. b is what a draft row costs: the number the controller must get right
to draft where drafting pays (SmolLM2 n-gram at 16-32 clients on the EPYC VM once measured 2.0 ms a
row where the controller predicted nothing). Steps with a prefill chunk are left out (a prompt's token
costs another price), and so are steps without a prediction (no controller decision: speculation off).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_STEPS = 8  # a bucket with fewer decided decode steps is not fitted


def bucket_label(num_sequences: int) -> tuple[int, str]:
    """(bucket, "lo-hi"): the controller's batch buckets, 1, 2-3, 4-7, 8-15, ..."""
    bucket = max(num_sequences, 1).bit_length()
    low, high = 1 << (bucket - 1), (1 << bucket) - 1
    return bucket, str(low) if low == high else f"{low}-{high}"


def _line(rows: list[tuple[int, int]], seconds: list[float]) -> dict[str, float | None]:
    """ms of base, a sequence and a draft row; a column the steps do not vary is not fitted (None)."""
    design = np.array([[1.0, n, d] for n, d in rows])  # [steps, 3]
    y = np.array(seconds) * 1e3  # [steps]
    keep = [0] + [j for j in (1, 2) if np.ptp(design[:, j]) > 0]
    coef, *_ = np.linalg.lstsq(design[:, keep], y, rcond=None)
    fitted: dict[int, float] = dict(zip(keep, (float(c) for c in coef), strict=True))
    return {
        "base_ms": fitted.get(0),
        "per_sequence_ms": fitted.get(1),
        "per_draft_ms": fitted.get(2),
    }


def fit_decode_costs(steps: list[Any]) -> list[dict[str, Any]]:
    """Per batch bucket with MIN_STEPS decided decode steps: the measured and predicted lines."""
    groups: dict[int, tuple[str, list[Any]]] = {}
    for s in steps:
        predicted = getattr(s, "predicted_seconds", None)
        if s.prefill_tokens or not isinstance(predicted, (int, float)):
            continue
        if not isinstance(getattr(s, "draft_tokens", None), int):
            continue
        bucket, label = bucket_label(s.num_sequences)
        groups.setdefault(bucket, (label, []))[1].append(s)
    out = []
    for bucket in sorted(groups):
        label, group = groups[bucket]
        if len(group) < MIN_STEPS:
            continue
        rows = [(s.num_sequences, s.draft_tokens) for s in group]
        out.append(
            {
                "sequences": label,
                "steps": len(group),
                "drafting_steps": sum(1 for s in group if s.draft_tokens),
                "measured": _line(rows, [s.step_seconds for s in group]),
                "predicted": _line(rows, [s.predicted_seconds for s in group]),
            }
        )
    return out
