"""In one process, as `bench ledger` builds the engine (the Qwen pair, int4 draft): a warm-up request per
mode, a first cell of FIRST (off or static K=1) at 4 clients (16 requests of 48 tokens, one admitted a
step), then an adaptive cell. Prints the controller's state after each cell (global acceptance per
proposal class, draft step prices, catch-up price, prices of a 4-sequence step by its tokens, the
guard, the payback records, the gain calibrations) and, for the adaptive cell, every decision:
(sequences, candidates, headroom, drafts chosen, candidates' catch-up tokens, their classes), with the
prices and rates behind the 3rd-12th decisions at 4 sequences.

    python first_cells.py off|static
"""

from __future__ import annotations

import argparse
import sys

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.benchmarks.step_ledger import _arms, _engine, run_cell


def main(first: str) -> None:
    args = argparse.Namespace(
        model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        quantization_encoding="bfloat16",
        max_length=4096,
        max_kv_cache_tokens=65536,
        speculative_method=None,
    )
    llm = _engine(args)
    prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories(None))]
    arms = {a.name: a.runner for a in _arms(["off", "static", "adaptive"], 1)}
    for name in ("off", "static", "adaptive"):
        run_cell(llm, prompts[:1], arms[name], 1, 1, 8)
    ctrl = llm.engine.controller
    cost = ctrl.cost

    def ms(seconds: float) -> int:
        return round(seconds * 1000)

    def dump(tag: str) -> None:
        print("==", tag)
        for h, c in sorted(ctrl.acceptance._global.items(), key=lambda kv: str(kv[0])):
            trials = [round(t, 1) for t in c.trials]
            hits = [round(x, 1) for x in c.hits]
            print(f"  global {h} rate {ctrl.acceptance.global_rate(h):.3f} trials {trials} hits {hits}")
        print("  draft steps", {b: [ms(x) for x in d] for b, d in cost._draft_steps.items()})
        print(
            "  setup per token ms",
            [round(x * 1000, 2) for x in cost._setup_token],
            "probe draft",
            cost._probe_draft,
        )
        for key, cal in sorted(cost._calibration.items()):
            print("  cal", key, f"weight {cal.weight:.1f}", "last", cal.last_shape, "settled", cal.settled)
        for n in (3, 4):
            steps = [
                cost.step_seconds(n, n + r, 0 if r == 0 else n, 0 if r == 0 else 1) for r in range(0, 13, 2)
            ]
            print(f"  prices n={n}", [ms(s) for s in steps], "draft4", ms(cost.draft_step_seconds(n)))
            print(f"  target n={n}", [ms(cost.target_seconds(n, n + r)) for r in range(0, 13)])
            print(
                "  shortfall",
                cost.shortfall(n, ctrl._gain_factors()),
                "stale",
                cost.plain_is_stale(n),
                "behind",
                cost.plain_is_behind(n),
                "measured",
                cost.plain_is_measured(n),
            )
        horizons = {b: round(h.mean, 1) for b, h in ctrl.payback._horizons.items()}
        print("  payback", horizons, "gain", ctrl._gain_factors(), "overhead", cost.overhead_seconds)

    dump("after warm-up")
    cell = run_cell(llm, prompts, arms[first], 4, 16, 48, 1)
    print(first, f"tok/s {cell['tokens'] / cell['seconds']:.2f}")
    dump("after " + first)
    real = ctrl.choose
    log = []

    def choose(cands, n, base, budget):
        d = real(cands, n, base, budget)
        log.append(
            (
                n,
                len(cands),
                d.headroom,
                sum(d.k.values()),
                [c.setup_tokens for c in cands],
                [c.hint for c in cands],
            )
        )
        if 3 <= len(log) <= 12 and n == 4:
            rates = [
                [round(a, 2) for a in ctrl.acceptance.rates(c.request_id, None, c.hint)[:4]] for c in cands
            ]
            print(
                "   decision",
                len(log),
                "plain",
                ms(cost.target_seconds(4, 4)),
                "fwd8",
                ms(cost.target_seconds(4, 8)),
                "fwd12",
                ms(cost.target_seconds(4, 12)),
                "draft4",
                ms(cost.draft_step_seconds(4)),
                "draft2",
                ms(cost.draft_step_seconds(2)),
                f"req_gain {ctrl.required_gain(4):.3f}",
                "gf",
                ctrl._gain_factors(),
                "rates",
                rates,
                "k",
                d.k,
                f"headroom {d.headroom:.2f}",
                "stale",
                cost.plain_is_stale(4),
                "behind",
                cost.plain_is_behind(4),
                "setup/token ms",
                round(cost.setup_seconds(100) * 10, 2),
            )
        return d

    ctrl.choose = choose
    cell = run_cell(llm, prompts, arms["adaptive"], 4, 16, 48, 1)
    print(f"adaptive tok/s {cell['tokens'] / cell['seconds']:.2f}")
    for row in log[:40]:
        print("  ", row)
    print("drafted decisions", sum(1 for r in log if r[3] > 0), "of", len(log))
    dump("after adaptive")


if __name__ == "__main__":
    main(sys.argv[1])
