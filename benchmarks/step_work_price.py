"""Each cell's work priced alike (`bench steps --serve-report`): one step-cost line fitted over every
cell's forwards, so that a ratio between two modes splits into what each mode had the engine do and
how fast the machine ran that work.

A served ratio mixes two things this 2-core VM cannot hold still: what the policy changes (steps,
sequences per step, draft rows, prefill chunks) and the machine's speed, which differs by up to 25%
between cells a minute apart (the cells' fitted speeds in one 16-client SmolLM2 run: 0.86-1.12). In
that run's sixteen pairs with one output length, adaptive / off measured 0.971x (median) where the work
each arm had the engine do, priced alike, came to 0.995x and the adaptive cells' speed to 0.975x (the
twenty-ninth session in docs/benchmarks.md).

The line: a forward's seconds = the cell's speed x (a constant, one for steps with a prompt's tokens and
one for decode-only steps, + per prompt token + per decode row + per draft row), least squares over
every step of every cell, alternating between the line and the cells' speeds. Without a speed per cell
the line takes up the machine's drift wherever a feature belongs to one mode: draft rows occur only in
speculating cells, and a slow spell in those priced a draft row at the slowness (SmolLM2, 16 clients:
2.4 ms a row without, 2.0 with). A cell's priced time is its forwards at the line's speed plus what it
measured outside them (the proposer and the engine's own time: the policy's costs, kept as measured).
Per pair of cells of one repeat: measured ratio ~= work ratio x speed ratio, where work is tokens over
priced time and speed is how fast the cell ran its forwards against the line. Not in the line:
attention's growth with context length (the log does not record it), so two modes whose sequences hold
very different contexts are not priced alike by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .stats import geomean, median

COEFFICIENTS = (
    "prefill_step_ms",
    "decode_step_ms",
    "per_prompt_token_ms",
    "per_decode_row_ms",
    "per_draft_row_ms",
)
REFERENCE_MODE = "off"
FIT_ROUNDS = 100  # alternations of line and speeds (converged to 1e-9 in ~20 on served logs)


def step_features(step: Any) -> list[float]:
    """[has a prompt, decode only, prompt tokens, decode rows, draft rows] of one step."""
    prompt = step.prefill_tokens
    drafts = step.draft_tokens
    rows = step.num_tokens - prompt - drafts  # one per decoding sequence
    with_prompt = 1.0 if prompt > 0 else 0.0
    return [with_prompt, 1.0 - with_prompt, float(prompt), float(rows), float(drafts)]


def has_shapes(step: Any) -> bool:
    return all(isinstance(getattr(step, f, None), int) for f in ("num_tokens", "draft_tokens"))


def fit_line(
    cells: list[list[Any]], features: Callable[[Any], list[float]] = step_features
) -> tuple[np.ndarray, list[float]]:
    """([F] seconds per feature at unit speed, each cell's slowness: its forwards' seconds over the
    line's), alternating least squares; the slownesses have a geometric mean of 1 (the line's scale is
    otherwise free). A feature no step has gets 0. `features`: a step's [F] regressors (by default the
    five of `step_features`)."""
    designs = [np.array([features(s) for s in steps]) for steps in cells]  # [steps, F] per cell
    seconds = [np.array([s.forward_seconds for s in steps]) for steps in cells]  # [steps] per cell
    slowness = np.ones(len(cells))
    coef = np.zeros(designs[0].shape[1])
    for _ in range(FIT_ROUNDS):
        target = np.concatenate([y / w for y, w in zip(seconds, slowness, strict=True)])
        coef, *_ = np.linalg.lstsq(np.vstack(designs), target, rcond=None)
        priced = np.array([float((x @ coef).sum()) for x in designs])
        new = np.array([float(y.sum()) for y in seconds]) / np.maximum(priced, 1e-12)
        new /= math.exp(float(np.mean(np.log(new))))
        done = bool(np.allclose(new, slowness, rtol=1e-9))
        slowness = new
        if done:
            break
    return coef, [float(w) for w in slowness]


def _mode(label: str) -> str:
    """A cell label's mode: "c16 adaptive" -> "adaptive"."""
    return label.split()[-1]


def _level(label: str) -> str:
    """A cell label's level: "c16 adaptive" -> "c16" (a label of one word has none)."""
    return label.rsplit(" ", 1)[0] if " " in label else ""


def _references(modes: list[str]) -> dict[str, str]:
    """level -> the mode its cells are paired against: its `off`, or the first of its modes seen. A
    run of several concurrencies pairs each one's cells within it (against the first level's off
    cells, the 4-client adaptive cells of a 1-32 client run came out 2.4x)."""
    references: dict[str, str] = {}
    for mode in modes:
        level = _level(mode)
        if level not in references or (
            _mode(mode) == REFERENCE_MODE and _mode(references[level]) != REFERENCE_MODE
        ):
            references[level] = mode
    return references


def price_cells(groups: list[tuple[str, int, list[Any]]]) -> dict[str, Any] | None:
    """Per cell its priced time and speed, per repeat each mode against `off` of its level (or the first
    mode seen there), and the medians / geometric means of the ratios; None when no cell's steps record
    their shapes."""
    kept = [
        (label, repeat, steps) for label, repeat, steps in groups if steps and all(map(has_shapes, steps))
    ]
    if not kept:
        return None
    coef, slowness = fit_line([steps for _, _, steps in kept])
    cells = []
    for (label, repeat, steps), slow in zip(kept, slowness, strict=True):
        forward = sum(s.forward_seconds for s in steps)
        priced_forward = float(np.array([step_features(s) for s in steps]).sum(axis=0) @ coef)
        outside = sum(s.step_seconds - s.forward_seconds for s in steps)
        tokens = sum(s.emitted_tokens for s in steps)
        cells.append(
            {
                "mode": label,
                "repeat": repeat,
                "tokens": tokens,
                "forward_s": forward,
                "priced_forward_s": priced_forward,
                "outside_forward_s": outside,
                "measured_tok_s": tokens / (forward + outside),
                "priced_tok_s": tokens / (priced_forward + outside),
                "speed": 1.0 / slow,  # > 1: this cell ran its forwards faster than the line
            }
        )
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    references = _references(modes)
    pairs = []
    by_repeat = {(c["mode"], c["repeat"]): c for c in cells}
    for c in cells:
        reference = references[_level(c["mode"])]
        ref = by_repeat.get((reference, c["repeat"]))
        if c["mode"] == reference or ref is None:
            continue
        pairs.append(
            {
                "mode": c["mode"],
                "reference": reference,
                "repeat": c["repeat"],
                "measured": c["measured_tok_s"] / ref["measured_tok_s"],
                "work": c["priced_tok_s"] / ref["priced_tok_s"],
                "speed": c["speed"] / ref["speed"],
            }
        )
    summary = []
    for mode in modes:
        mine = [p for p in pairs if p["mode"] == mode]
        if not mine:
            continue
        row: dict[str, Any] = {"mode": mode, "reference": references[_level(mode)], "pairs": len(mine)}
        for key in ("measured", "work", "speed"):
            row[f"{key}_median"] = median(p[key] for p in mine)
            row[f"{key}_geometric"] = geomean(p[key] for p in mine)
        summary.append(row)
    return {
        "coefficients_ms": dict(zip(COEFFICIENTS, (float(c) * 1e3 for c in coef), strict=True)),
        "cells": cells,
        "pairs": pairs,
        "summary": summary,
    }
