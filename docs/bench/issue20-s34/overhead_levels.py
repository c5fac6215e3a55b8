"""What the adaptive policy's machinery costs a cell when it drafts nothing, at C clients: the
thirty-third session's `overhead.py` (closed_loop.py's engine with wall-clock timers on the speculation
plan, the n-gram previews, the controller's choice, the commit and the step's observation; `off`
against `nodraft`), for any number of clients. Prints milliseconds per cell and per step.

    python overhead_levels.py CLIENTS [REPEATS]
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

os.environ["ARMS"] = "off,nodraft"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-tail-s33"))
import closed_loop  # noqa: E402 (reads ARMS at import)

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.engine import engine_core, scheduler, spec_controller  # noqa: E402

spent: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


closed_loop.patch_nodraft()
for owner, name in [
    (scheduler.Scheduler, "_speculation_plan"),
    (engine_core.EngineCore, "_preview"),
    (spec_controller.SpeculationController, "choose"),
    (spec_controller.SpeculationController, "observe_verification"),
    (engine_core.EngineCore, "_commit"),
    (engine_core.EngineCore, "_observe_step"),
    (engine_core.EngineCore, "_forward"),
    (engine_core.EngineCore, "step"),
]:
    closed_loop.time_calls(owner, name, spent, calls)
clients = int(sys.argv[1])
engine = closed_loop.build_engine()
prompts = [engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))]
for mode in ("off", "nodraft"):
    closed_loop.run_cell(engine, prompts, clients, mode, 0, clients, 0.0)
per_cell = clients * 6
for repeat in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for mode in ("off", "nodraft"):
        spent.clear()
        calls.clear()
        seconds = closed_loop.run_cell(engine, prompts, clients, mode, 100 + per_cell * repeat, per_cell, 0.0)
        steps = calls["step"]
        parts = " ".join(
            f"{k} {1e3 * v:.0f} ms ({1e3 * v / steps:.2f}/step)"
            for k, v in sorted(spent.items())
            if k != "step"
        )
        print(f"{clients} clients {mode} {seconds:.2f} s, {steps} steps; {parts}", flush=True)
