"""Replay logged forwards through the controller's StepCostModel (its target calibration only) and see
what it priced a draft row at, per cell, before each drafting step taught it; with the committed
floor ("never below the plain step") and two floors tried this session and not kept.

    python docs/bench/issue20-draft-row-price-replay-s29/replay.py

Inputs: the 16-client SmolLM2 run of this session (a served step log) and the batch-1 K sweep of the
twenty-seventh session (`forward_costs` of its adaptive arm). The profile is the start-up profile of
SmolLM2 bf16 measured in-process on this machine this session (tokens, ms).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specserve.benchmarks.step_log_report import serve_cells
from specserve.engine.step_cost_model import StepCostModel, _calibration_key

BENCH = Path(__file__).parent.parent
SERVED = BENCH / "issue20-serve-smollm2-epyc512-c16-r16-s29"
BATCH1 = BENCH / "issue20-policy-smollm2-epyc512-k1-8-s27" / "spec_policy.json"
PROFILE_MS = [(1, 29.9), (2, 31.7), (3, 33.5), (4, 35.6), (5, 36.6), (6, 36.9), (7, 37.3), (8, 38.0), (10, 40.2),
              (12, 42.2), (16, 45.0), (20, 45.8), (24, 48.6), (32, 55.2), (48, 69.4), (64, 99.9), (96, 130.0),
              (128, 159.2)]  # fmt: skip


def prices(cost: StepCostModel, n: int, tokens: int) -> tuple[float, dict[str, float]]:
    """(the plain step's price, the step's price by each floor)."""
    key = _calibration_key(n, tokens, 0)
    plain_key = (key[0], key[1], False)
    own, plain_cal = cost._calibration.get(key), cost._calibration.get(plain_key)
    committed = cost.target_seconds(n, tokens, 0)
    if own is None or plain_cal is None:
        return cost.target_seconds(n, n, 0), {
            "committed": committed,
            "own slope": committed,
            "half stand-in": committed,
        }
    plain = plain_cal.predict(cost._regressor(plain_key, n, n))
    own_price = own.predict(cost.curve(tokens))
    rows = cost.curve(tokens) - cost.curve(n)
    stand_in = plain * (cost.curve(tokens) / cost.curve(n) - 1)  # the plain price grown along the profile
    return plain, {
        "committed": committed,
        "own slope": max(committed, plain + own.slope * rows),
        "half stand-in": own_price if own_price >= plain + 0.5 * stand_in else plain + 0.5 * stand_in,
    }


def replay(forwards: list[tuple[int, int, float, int | None, str | None]]) -> dict[str, list[tuple]]:
    """forwards: (sequences, tokens, seconds, prompt tokens or None, cell). Per cell, every decode
    forward with draft rows: (draft rows, plain price, {floor: price}, measured)."""
    cost = StepCostModel([(n, ms / 1e3) for n, ms in PROFILE_MS])
    out: dict[str, list[tuple]] = {}
    for n, tokens, seconds, prompt, cell in forwards:
        if tokens > n and not prompt and cell is not None:
            plain, priced = prices(cost, n, tokens)
            out.setdefault(cell, []).append((tokens - n, plain, priced, seconds))
        cost.observe_target(n, tokens, seconds, prompt)
    return out


def per_row(rows: list[tuple], floor: str | None) -> float:
    """ms a draft row over the plain price, summed over the cell's drafting forwards."""
    drafts = sum(r[0] for r in rows)
    return 1e3 * sum((r[2][floor] if floor else r[3]) - r[1] for r in rows) / drafts


def main() -> None:
    steps = [
        SimpleNamespace(**json.loads(line)) for line in (SERVED / "steps.jsonl").read_text().splitlines()
    ]
    cells = serve_cells(SERVED / "serve.json")

    def cell_of(t: float) -> str | None:
        return next((f"{label.split()[1]} r{r}" for label, r, a, b in cells if a <= t <= b), None)

    served = replay(
        [(s.num_sequences, s.num_tokens, s.forward_seconds, s.prefill_tokens, cell_of(s.time)) for s in steps]
    )
    print("16 SmolLM2 clients, adaptive cells: ms a draft row over the plain price")
    print("cell | drafting steps | committed | own slope | half stand-in | measured - plain price")
    for cell, rows in served.items():
        print(
            f"{cell} | {len(rows)} | "
            + " | ".join(f"{per_row(rows, f):.2f}" for f in ("committed", "own slope", "half stand-in"))
            + f" | {per_row(rows, None):.2f}"
        )
    report = json.loads(BATCH1.read_text())
    forwards = [(n, t, m, None, "batch 1") for r in report["results"] for n, t, _, m in r["forward_costs"]]
    # Windows only (up to 8 drafts): longer forwards at one sequence are prompts.
    rows = [r for r in replay([f for f in forwards if not (f[1] > f[0] and f[1] - f[0] > 8)])["batch 1"]]
    print(f"\nbatch 1 (SmolLM2 K sweep, twenty-seventh session), {len(rows)} window forwards:")
    for floor in ("committed", "own slope", "half stand-in"):
        error = np.median([abs(r[2][floor] / r[3] - 1) for r in rows])
        print(
            f"{floor}: {per_row(rows, floor):.2f} ms a row (measured {per_row(rows, None):.2f}), median |error| {error:.3f}"
        )


if __name__ == "__main__":
    main()
