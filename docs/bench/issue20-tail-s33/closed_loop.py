"""`bench serve`'s closed loop in one process, without HTTP: the served engine's configuration (built from
the `serve` command line, so with its heap settings), C clients drawing from one pool of C x PER_CLIENT
requests of 32 tokens (EOS ignored, greedy, the bench's prompt order), two arms alternated per repeat.

    python closed_loop.py CLIENTS REPEATS [RANGE_RATIO]
    ARMS=off,nodraft ...   # nodraft: the adaptive policy with every k forced to 0 (its previews,
                           # controller and bookkeeping run; no drafts)
    OUT=dir ...            # dir/steps.jsonl (the step log), dir/cells.json (cell windows, read like a
                           # bench serve report by cells.py, tail.py, `bench steps --serve-report`)
    FWDLOG=1 OUT=dir ...   # dir/fwd.jsonl: every target forward's (query length, context, block breaks)
    PER_CLIENT=24 ...      # requests per client (default 6, as the issue-20 runs)
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from typing import Any

from specserve.api.cli import ServeSettings, build_parser
from specserve.api.settings import engine_config_from, parse_settings
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.benchmarks.serve import request_max_tokens
from specserve.engine import spec_controller
from specserve.engine.engine_core import EngineCore
from specserve.engine.sampling_params import SamplingParams

ARMS = os.environ.get("ARMS", "off,adaptive").split(",")
OUT = os.environ.get("OUT")
PER_CLIENT = int(os.environ.get("PER_CLIENT", "6"))
forced_off = {"on": False}  # the nodraft arm's switch, read by the patched choose


def build_engine() -> EngineCore:
    extra = ["--step-log", f"{OUT}/steps.jsonl"] if OUT else []
    flags = ["serve", "--max-kv-cache-tokens", "131072", "--num-threads", "2", "--log-stats-interval", "0"]
    args = build_parser().parse_args([*flags, *extra])
    engine = EngineCore(engine_config_from(parse_settings(ServeSettings, args)))
    if OUT and os.environ.get("FWDLOG"):
        log_forwards(engine, open(f"{OUT}/fwd.jsonl", "w"))  # noqa: SIM115 (open for the run)
    return engine


def log_forwards(engine: EngineCore, out: Any) -> None:
    real = engine._forward

    def logged(batch: Any) -> Any:
        start = time.perf_counter()
        result = real(batch)
        seconds = time.perf_counter() - start
        seqs = [
            (
                len(s.token_ids),
                s.start_position + len(s.token_ids),
                sum(1 for a, b in zip(s.block_ids, s.block_ids[1:], strict=False) if b != a + 1),
            )
            for s in batch.sequences
        ]
        out.write(json.dumps({"time": time.time(), "seconds": seconds, "seqs": seqs}) + "\n")
        return result

    engine._forward = logged


def patch_nodraft() -> None:
    real = spec_controller.SpeculationController.choose

    def choose(self: Any, candidates: Any, *args: Any, **kwargs: Any) -> Any:
        decision = real(self, candidates, *args, **kwargs)
        if forced_off["on"]:
            decision.k = dict.fromkeys(decision.k, 0)
            decision.probed = []
        return decision

    spec_controller.SpeculationController.choose = choose


def params(mode: str, max_tokens: int) -> SamplingParams:
    forced_off["on"] = mode == "nodraft"
    if mode == "off":
        return SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative_enabled=False
        )
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative_policy="adaptive"
    )


def time_calls(
    owner: Any,
    name: str,
    spent: collections.Counter[str],
    calls: collections.Counter[str] | None = None,
    label: str | None = None,
) -> None:
    """Wrap `owner.name` so that every call adds its wall-clock seconds to spent[label or name] (and one
    to calls[label or name]): the timers of overhead.py and the scripts in ../issue20-s34/."""
    real, key = getattr(owner, name), label or name

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
            if calls is not None:
                calls[key] += 1

    setattr(owner, name, wrapper)


def run_cell(
    engine: EngineCore, prompts: list[list[int]], clients: int, mode: str, start: int, num: int, ratio: float
) -> float:
    """Seconds until `num` requests from index `start` finished, `clients` in flight at a time."""
    issued, in_flight = 0, 0

    def issue() -> None:
        nonlocal issued, in_flight
        index = start + issued
        issued += 1
        in_flight += 1
        tokens = request_max_tokens(32, ratio, index)
        request = engine.make_request(prompts[index % len(prompts)], params(mode, tokens), f"{mode}-{index}")
        engine.add_request(request)

    began = time.perf_counter()
    for _ in range(clients):
        issue()
    while in_flight:
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                if issued < num:
                    issue()
    return time.perf_counter() - began


def main() -> None:
    clients, repeats = int(sys.argv[1]), int(sys.argv[2])
    ratio = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    if "nodraft" in ARMS:
        patch_nodraft()
    engine = build_engine()
    prompts = [
        engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))
    ]
    for mode in ARMS:
        run_cell(engine, prompts, clients, mode, 0, 1, ratio)  # warm-up
    num, start, ratios, cells = clients * PER_CLIENT, 0, [], []
    first, second = ARMS
    for repeat in range(repeats):
        seconds = {}
        for mode in (first, second) if repeat % 2 == 0 else (second, first):
            started = time.time()
            seconds[mode] = run_cell(engine, prompts, clients, mode, start, num, ratio)
            cells.append(
                {
                    "concurrency": clients,
                    "mode": mode,
                    "repeat": repeat,
                    "started": started,
                    "ended": time.time(),
                }
            )
        start += num
        ratios.append(seconds[first] / seconds[second])
        print(
            f"r{repeat} {first} {seconds[first]:.2f} s {second} {seconds[second]:.2f} s"
            f" {second}/{first} {ratios[-1]:.3f}",
            flush=True,
        )
    print("median", round(statistics.median(ratios), 3), "geo", round(statistics.geometric_mean(ratios), 3))
    if OUT:
        with open(f"{OUT}/cells.json", "w") as f:
            json.dump({"cells": cells}, f)


if __name__ == "__main__":
    main()
