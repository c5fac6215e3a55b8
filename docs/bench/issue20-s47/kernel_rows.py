"""How many rows our bf16 linear kernel (engine/bf16_matmul.c) should take before torch's (oneDNN):
whole steps in an engine, by prompt length, with the cap (small_batch_linear.MAX_KERNEL_ROWS) set to
each value given. One engine (speculation off, greedy, one output token: the step is the prompt's
prefill, the forward of as many rows as the prompt has tokens); prompts of distinct token ids so no
prefix is cached; the caps take turns, their order reversed every round. Prints the median step time
of each prompt length and cap and its ratio to the first cap's.

    python kernel_rows.py MODEL LENGTHS CAPS ROUNDS
    python kernel_rows.py HuggingFaceTB/SmolLM2-135M-Instruct 40,56,64,80,96,112,128,160,192,256 48,128 6
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from tqdm import tqdm

import specserve.engine.models.small_batch_linear as small_batch_linear
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams


def prompt(length: int, salt: int) -> list[int]:
    return [(t * 7 + salt * 131) % 40000 + 100 for t in range(length)]


def main() -> None:
    model, lengths_arg, caps_arg, rounds_arg = sys.argv[1:5]
    lengths = [int(a) for a in lengths_arg.split(",")]
    caps = [int(a) for a in caps_arg.split(",")]
    torch.set_num_threads(2)
    llm = LLM(model_path=model, max_kv_cache_tokens=65536, max_length=4096)
    engine = llm.engine
    llm.generate(["warm up"], SamplingParams(max_tokens=8))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, speculative_enabled=False)
    times: dict[tuple[int, int], list[float]] = {}
    salt = 0
    rounds = int(rounds_arg)
    with tqdm(total=rounds * len(lengths) * len(caps), desc="prefill steps") as bar:
        for r in range(rounds):
            for length in lengths:
                for cap in caps if r % 2 == 0 else caps[::-1]:
                    small_batch_linear.MAX_KERNEL_ROWS = cap
                    salt += 1
                    engine.add_request(engine.make_request(prompt(length, salt), params))
                    start = time.perf_counter()
                    engine.step()
                    times.setdefault((length, cap), []).append(time.perf_counter() - start)
                    while engine.has_work():
                        engine.step()
                    bar.update()
    print(f"{model}, torch {torch.__version__}, 2 threads; median step ms (ratio to cap {caps[0]})")
    for length in lengths:
        first = statistics.median(times[(length, caps[0])])
        cells = []
        for cap in caps:
            t = statistics.median(times[(length, cap)])
            cells.append(f"cap {cap}: {t * 1e3:7.1f} ms ({t / first:.3f})")
        print(f"prompt {length:4d} tokens: " + "  ".join(cells))


if __name__ == "__main__":
    main()
