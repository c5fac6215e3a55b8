"""The controller's choice of k, replayed: record every `SpeculationController.choose` call of one cell
(closed_loop.py's engine, the `nodraft` arm: the adaptive policy with every k forced to 0) with the
controller as it was before the call; replay them on the recorded controllers, timing the calls and
keeping the decisions, so that two versions of the code can be timed on the same calls and their
decisions compared.

    python choose_replay.py record CALLS.pkl CLIENTS
    python choose_replay.py replay CALLS.pkl DECISIONS.pkl
    python choose_replay.py compare OLD.pkl NEW.pkl
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

os.environ["ARMS"] = "off,nodraft"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-tail-s33"))

from specserve.engine import spec_controller  # noqa: E402


def record(path: str, clients: int) -> None:
    import closed_loop

    from specserve.benchmarks.prompt_sets import load_prompts, parse_categories

    real = spec_controller.SpeculationController.choose
    calls: list[bytes] = []

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(pickle.dumps((self, args, kwargs)))
        return real(self, *args, **kwargs)

    spec_controller.SpeculationController.choose = recording
    closed_loop.patch_nodraft()
    engine = closed_loop.build_engine()
    prompts = [
        engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))
    ]
    closed_loop.run_cell(engine, prompts, clients, "nodraft", 0, clients, 0.0)  # warm-up
    calls.clear()
    closed_loop.run_cell(engine, prompts, clients, "nodraft", 100, 6 * clients, 0.0)
    Path(path).write_bytes(pickle.dumps(calls))
    print("recorded", len(calls), "calls")


def replay(path: str, out: str, rounds: int = 5) -> None:
    calls = pickle.loads(Path(path).read_bytes())
    best, curve = float("inf"), {}
    for _ in range(rounds):
        recorded = [pickle.loads(c) for c in calls]
        for controller, _, _ in recorded:
            # The profile's memo (a newer StepCostModel's) lives on in the engine: share one here.
            controller.cost.__dict__["_curve"] = curve
        start = time.perf_counter()
        decisions = [controller.choose(*args, **kwargs) for controller, args, kwargs in recorded]
        best = min(best, time.perf_counter() - start)
    print(f"{len(calls)} calls, best of {rounds}: {1e6 * best / len(calls):.1f} us a call")
    kept = [
        (d.k, d.predicted_tokens, d.predicted_seconds, d.probed, d.free, d.setup_tokens, d.static_drafts)
        for d in decisions
    ]
    Path(out).write_bytes(pickle.dumps(kept))


def compare(old: str, new: str) -> None:
    a, b = pickle.loads(Path(old).read_bytes()), pickle.loads(Path(new).read_bytes())
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    print(f"{len(a)} decisions, {len(differ)} differ", differ[:5])


if __name__ == "__main__":
    {
        "record": lambda: record(sys.argv[2], int(sys.argv[3])),
        "replay": lambda: replay(sys.argv[2], sys.argv[3]),
    }.get(sys.argv[1], lambda: compare(sys.argv[2], sys.argv[3]))()
