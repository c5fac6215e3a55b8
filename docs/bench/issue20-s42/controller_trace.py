"""What the adaptive controller saw at every decision, in one process: the Qwen pair as `serve` builds
it, closed-loop cells of 4 x CLIENTS requests (48 tokens, greedy, EOS ignored, the bench's prompt order)
under the adaptive policy, after one warm-up request (adaptive too, and traced).

    python controller_trace.py OUT.jsonl CLIENTS CELLS

Each line is one `choose`: batch size and tokens, the bar drafting must clear (`req`, MIN_GAIN x the
guard's shortfall), the gain calibrations (costly, free), the global acceptance per proposal class, the
plain step's price, a draft step's price at one request and at the batch, the per-token catch-up price,
the payback horizon at the batch's bucket, each candidate (id, cap, free, class, catch-up tokens, tokens
left, first-draft acceptance), and for each costly candidate alone the plan's goodput against the plain
step for k = 1..cap (`gk`: its catch-up charged as `choose` charges it); then the k chosen and the
prediction. A line {"cell": [clients, repeat, first prompt]} starts each cell.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from specserve.api.cli import ServeSettings, build_parser
from specserve.api.settings import engine_config_from, parse_settings
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import spec_controller as sc
from specserve.engine.engine_core import EngineCore
from specserve.engine.sampling_params import SamplingParams

FLAGS = [
    "serve",
    "--model-path",
    "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "--draft-model-path",
    "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "--draft-quantization-encoding",
    "int4",
    "--max-kv-cache-tokens",
    "65536",
    "--max-length",
    "4096",
    "--num-threads",
    "2",
    "--log-stats-interval",
    "0",
]


def alone_goodputs(ctrl: Any, candidates: Any, num_sequences: int) -> dict[str, list[float]]:
    """Per costly candidate, k = 1..cap: the step's goodput with only its drafts over the plain step's."""
    pricer = ctrl.cost.step_pricer(num_sequences)
    plain = pricer(num_sequences, 0, 0)
    factor = ctrl.gain_calibration[False].factor
    out = {}
    for c in candidates:
        if c.cap <= 0 or c.free or c.static:
            continue
        rates = ctrl.acceptance.rates(c.request_id, None, c.hint)
        catch_up = ctrl._catch_up(c, num_sequences) if c.setup_tokens >= sc.SETUP_MIN_TOKENS else None
        row = []
        for k in range(1, min(c.cap, ctrl.k_max) + 1):
            tokens = 1 + factor * (sc.expected_tokens(rates, k) - 1)
            seconds = pricer(num_sequences + k, 1, k) + (catch_up.charge(tokens) if catch_up else 0.0)
            row.append(round((tokens + len(candidates) - 1) / seconds * plain / len(candidates), 2))
        out[c.request_id] = row
    return out


def traced(out: Any) -> Any:
    real = sc.SpeculationController.choose

    def choose(self: Any, candidates: Any, num_sequences: int, base_tokens: int, token_budget: int) -> Any:
        cost = self.cost
        info: dict[str, Any] = {
            "t": time.time(),
            "n": num_sequences,
            "base": base_tokens,
            "req": round(self.required_gain(num_sequences), 3),
            "fac": [
                round(self.gain_calibration[False].factor, 3),
                round(self.gain_calibration[True].factor, 3),
            ],
            "g": {str(h): round(self.acceptance.global_rate(h), 3) for h in {c.hint for c in candidates}},
            "plain": round(cost.step_seconds(num_sequences, num_sequences, 0, 0), 4),
            "dstep1": round(cost.draft_step_seconds(1), 4),
            "dstep": round(cost.draft_step_seconds(max(1, len(candidates))), 4),
            "setup1": round(cost.setup_seconds(100) / 100, 5),
            "hz": self.payback.horizon(sc.batch_bucket(num_sequences)),
            "c": [
                [c.request_id, c.cap, int(c.free), c.hint, c.setup_tokens, c.tokens_left]
                + [round(self.acceptance.rates(c.request_id, None, c.hint)[0], 2)]
                for c in candidates
            ],
            "gk": alone_goodputs(self, candidates, num_sequences),
        }
        decision = real(self, candidates, num_sequences, base_tokens, token_budget)
        info["k"] = {r: v for r, v in decision.k.items() if v}
        info["probed"] = len(decision.probed)
        info["pt"] = round(decision.predicted_tokens, 2)
        info["ps"] = round(decision.predicted_seconds, 4)
        out.write(json.dumps(info) + "\n")
        out.flush()
        return decision

    sc.SpeculationController.choose = choose


def run_cell(engine: EngineCore, prompts: list[list[int]], clients: int, start: int, tag: str) -> float:
    issued = in_flight = 0
    num = 4 * clients

    def issue() -> None:
        nonlocal issued, in_flight
        index = start + issued
        issued += 1
        in_flight += 1
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, speculative_policy="adaptive")
        engine.add_request(engine.make_request(prompts[index % len(prompts)], params, f"{tag}-{index}"))

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
    path, clients, cells = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(path, "w") as out:
        traced(out)
        engine = EngineCore(
            engine_config_from(parse_settings(ServeSettings, build_parser().parse_args(FLAGS)))
        )
        prompts = [
            engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))
        ]
        warm = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, speculative_policy="adaptive")
        engine.add_request(engine.make_request(prompts[0], warm, "warm-0"))  # traced too
        while engine.has_work():
            engine.step()
        start = 0
        for repeat in range(cells):
            out.write(json.dumps({"cell": [clients, repeat, start]}) + "\n")
            print(
                clients, repeat, round(run_cell(engine, prompts, clients, start, f"c{clients}r{repeat}"), 2)
            )
            start += 4 * clients


if __name__ == "__main__":
    main()
