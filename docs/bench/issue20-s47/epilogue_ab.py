"""Our bf16 linear kernel (engine/bf16_matmul.c) against an earlier version of its source, whole
generations in one engine: the target model's SmallBatchLinear layers and its decode stack are pointed
at one build or the other, set by set (the two arms back to back, their order alternating by round). Each round generates the same
greedy tokens (checked) for: one request, four at once, and sixteen at once (64 tokens each,
speculation off, EOS ignored), and a batch of 8 short prompts with one output token (their prefill).
Prints each arm's median seconds per set, wall clock and the sum of its steps' forwards (decode-only
steps, or prefill steps for the last set), and the ratios.

    python epilogue_ab.py OLD_SOURCE.c ROUNDS [MODEL]
    git show 6bca357:engine/bf16_matmul.c > /tmp/bf16_old.c && python epilogue_ab.py /tmp/bf16_old.c 5
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from epilogue_layers import build  # this folder's: the earlier source's build
from tqdm import tqdm

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.bf16_kernel import Bf16Kernel, default_bf16_kernel
from specserve.engine.decode_stack import default_decode_stack_kernel, use_decode_stack
from specserve.engine.llm import LLM
from specserve.engine.models.small_batch_linear import SmallBatchLinear
from specserve.engine.sampling_params import SamplingParams


def main() -> None:
    old_source, rounds = Path(sys.argv[1]), int(sys.argv[2])
    model = sys.argv[3] if len(sys.argv) > 3 else "HuggingFaceTB/SmolLM2-135M-Instruct"
    torch.set_num_threads(2)
    new = default_bf16_kernel()
    assert new is not None, "the bf16 kernel does not build here"
    with tempfile.TemporaryDirectory() as cache:
        old = build(old_source, Path(cache))
    llm = LLM(model_path=model, max_kv_cache_tokens=65536, max_length=4096)
    target = llm.engine.model
    stack_kernel = default_decode_stack_kernel()

    def use(kernel: Bf16Kernel) -> None:
        for module in target.modules():
            if isinstance(module, SmallBatchLinear):
                module.kernel = kernel
        if stack_kernel is not None:
            use_decode_stack(target, stack_kernel)

    prompts = [p.messages for p in load_prompts(list(CATEGORIES), 3)]
    decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, speculative_enabled=False)
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, speculative_enabled=False)
    sets = {
        "1 request, 64 tokens": ([prompts[0]], decode),
        "4 requests, 64 tokens": (prompts[:4], decode),
        "16 requests, 64 tokens": (prompts[:16], decode),
        "8 prompts' prefill": (prompts[8:16], prefill),
    }
    llm.generate(["warm up"], SamplingParams(max_tokens=8))
    times: dict[tuple[str, str], list[float]] = {}
    forwards: dict[tuple[str, str], list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    engine = llm.engine
    step = engine.step
    counted = {"prefill": 0.0, "decode": 0.0}

    def timed_step() -> object:
        before = engine.stats.events.steps[-1] if engine.stats.events.steps else None
        out = step()
        last = engine.stats.events.steps[-1] if engine.stats.events.steps else None
        if last is not None and last is not before:
            counted["prefill" if last.prefill_tokens else "decode"] += last.forward_seconds
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    arms = {"old": old, "new": new}
    with tqdm(total=rounds * len(arms) * len(sets), desc="generations") as bar:
        for r in range(rounds):
            for name, (batch, params) in sets.items():
                for arm in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    use(arms[arm])
                    counted.update(prefill=0.0, decode=0.0)
                    start = time.perf_counter()
                    got = [o.token_ids for o in llm.generate(batch, params)]
                    times.setdefault((name, arm), []).append(time.perf_counter() - start)
                    kind = "prefill" if params is prefill else "decode"
                    forwards.setdefault((name, arm), []).append(counted[kind])
                    if tokens.setdefault(name, got) != got:
                        print(f"round {r}, {arm}: {name} tokens differ")
                    bar.update()
    print(f"{model}: median seconds over {rounds} rounds (new / old)")
    for name in sets:
        o, n = (statistics.median(times[(name, a)]) for a in ("old", "new"))
        fo, fn = (statistics.median(forwards[(name, a)]) for a in ("old", "new"))
        print(
            f"{name:24s} wall: old {o:7.3f} s  new {n:7.3f} s  new / old {n / o:.3f};"
            f"  forwards: old {fo:7.3f} s  new {fn:7.3f} s  new / old {fn / fo:.3f}"
        )


if __name__ == "__main__":
    main()
