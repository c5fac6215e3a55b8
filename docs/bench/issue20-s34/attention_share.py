"""Where a cell's forward time goes between attention and the rest: closed_loop.py's engine (the served
configuration) with wall-clock timers on the CPU backend's two attention paths (decodes and windows as
matmuls, prefill chunks as blocked SDPA) and on the whole forward, speculation off.

    python attention_share.py CLIENTS [CLIENTS ...]
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-tail-s33"))
import closed_loop  # noqa: E402

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.engine import attention, engine_core  # noqa: E402

spent: collections.Counter[str] = collections.Counter()


closed_loop.time_calls(attention, "_matmul_attention", spent, label="decode attention")
closed_loop.time_calls(attention, "_blocked_sdpa_attention", spent, label="prefill attention")
closed_loop.time_calls(engine_core.EngineCore, "_forward", spent, label="forward")
engine = closed_loop.build_engine()
prompts = [engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))]
closed_loop.run_cell(engine, prompts, 8, "off", 0, 8, 0.0)  # warm-up
for clients in map(int, sys.argv[1:]):
    spent.clear()
    seconds = closed_loop.run_cell(engine, prompts, clients, "off", 100, 6 * clients, 0.0)
    forward = spent["forward"]
    print(
        f"{clients} clients: cell {seconds:.2f} s, forwards {forward:.2f} s;"
        f" decode attention {spent['decode attention']:.2f} s ({spent['decode attention'] / forward:.0%}),"
        f" prefill attention {spent['prefill attention']:.2f} s ({spent['prefill attention'] / forward:.0%})"
    )
