"""Why adaptive k~0 plain steps ran 2x slower than off on the n-gram engine (H200): per-step records
and profiles, off/adaptive alternating."""

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ledger as g

from specserve.benchmarks.step_ledger import _arms, run_cell


def main():
    g.OUT.mkdir(parents=True, exist_ok=True)
    llm = g.ngram_target_engine()
    prompts = [
        llm.tokenizer.apply_chat_template(p.messages) for p in g.load_prompts(g.parse_categories(None))
    ]
    arms = {a.name: a for a in _arms(["off", "static", "adaptive"], 5)}
    for a in arms.values():
        run_cell(llm, prompts[:1], a.runner, 1, 1, 8)
    out = {"cells": []}
    plan = [
        (16, "off"),
        (16, "adaptive"),
        (16, "off"),
        (16, "adaptive"),
        (4, "adaptive"),
        (4, "off"),
        (16, "static"),
        (16, "adaptive"),
        (16, "off"),
    ]
    for i, (c, mode) in enumerate(plan):
        if time.perf_counter() - g.START > g.BUDGET:
            break
        prof = cProfile.Profile() if i in (2, 3) else None
        if prof:
            prof.enable()
        cell = run_cell(llm, prompts, arms[mode].runner, c, 2 * c, 64)
        if prof:
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            (g.OUT / f"prof_{mode}.txt").write_text(s.getvalue())
        steps = [
            (
                r.num_sequences,
                r.num_tokens,
                r.prefill_tokens,
                r.drafting,
                r.draft_tokens,
                r.probes,
                round(r.forward_seconds * 1e3, 2),
                round(r.step_seconds * 1e3, 2),
                round(r.draft_seconds * 1e3, 2),
            )
            for r in cell["steps"]
        ]
        dec = [s for s in steps if not s[2]]
        fw = sorted(s[6] for s in dec)
        g.log(
            f"c={c} {mode} {cell['tokens'] / cell['seconds']:.1f} tok/s; decode steps {len(dec)}, forward ms median "
            f"{fw[len(fw) // 2] if fw else 0}, rows/step {sum(s[1] for s in dec) / max(1, len(dec)):.2f}"
        )
        out["cells"].append({"c": c, "mode": mode, "tok_s": cell["tokens"] / cell["seconds"], "steps": steps})
        (g.OUT / "diag.json").write_text(json.dumps(out))


main()
