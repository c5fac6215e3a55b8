"""What the adaptive policy's own machinery costs a cell when it drafts nothing: closed_loop.py's engine
with wall-clock timers on the scheduler's speculation plan (previews and the controller's choice),
the commit (the controller's verification feedback), the step's observation; `off` against `nodraft`.

    python overhead.py [REPEATS]
"""

from __future__ import annotations

import collections
import os
import sys

os.environ["ARMS"] = "off,nodraft"
import closed_loop  # noqa: E402 (reads ARMS at import)

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.engine import engine_core, scheduler, spec_controller  # noqa: E402

spent: collections.Counter[str] = collections.Counter()


closed_loop.patch_nodraft()
for owner, name in [
    (scheduler.Scheduler, "_speculation_plan"),
    (scheduler.Scheduler, "_candidate"),
    (spec_controller.SpeculationController, "choose"),
    (spec_controller.SpeculationController, "observe_verification"),
    (engine_core.EngineCore, "_commit"),
    (engine_core.EngineCore, "_observe_step"),
    (engine_core.EngineCore, "_forward"),
    (engine_core.EngineCore, "step"),
]:
    closed_loop.time_calls(owner, name, spent)
engine = closed_loop.build_engine()
prompts = [engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))]
for mode in ("off", "nodraft"):
    closed_loop.run_cell(engine, prompts, 8, mode, 0, 8, 0.0)
for repeat in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for mode in ("off", "nodraft"):
        spent.clear()
        seconds = closed_loop.run_cell(engine, prompts, 8, mode, 100 + 48 * repeat, 48, 0.0)
        print(mode, f"{seconds:.2f} s;", " ".join(f"{k} {1e3 * v:.0f} ms" for k, v in sorted(spent.items())))
