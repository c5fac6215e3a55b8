"""SmolLM2 (n-gram) in one process, BATCH requests at a time: the adaptive policy with quiet spells
as built (QUIET_SHARE) and weighing every step (quiet_share infinite), taking turns over the
benchmark's prompts (two a category, in groups of BATCH decoded together), 64 greedy tokens each (EOS
ignored), ROUNDS rounds with the order alternating. Output tokens a second, quiet steps, drafts
proposed and accepted per arm, and whether the arms' tokens were the same.

    python quiet_ab.py ROUNDS [BATCH]
"""

from __future__ import annotations

import math
import sys
import time

import torch

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_controller import QUIET_SHARE

ARMS = {"quiet spells": QUIET_SHARE, "weigh every step": math.inf}


def main() -> None:
    rounds = int(sys.argv[1])
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(2)
    llm = LLM(max_kv_cache_tokens=131072)
    engine = llm.engine
    controller = engine.controller
    assert controller is not None
    prompts = [p.messages for p in load_prompts(list(CATEGORIES), 2)]
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    tokens: dict[str, list[list[int]]] = {}
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(["warm up"], params)
    totals = {arm: {"tokens": 0, "seconds": 0.0, "quiet": 0, "drafts": 0, "accepted": 0} for arm in ARMS}
    for r in range(rounds):
        for arm in list(ARMS) if r % 2 == 0 else list(reversed(ARMS)):
            controller.quiet_share = ARMS[arm]
            quiet_before = engine.stats.spec.quiet_steps
            start = time.perf_counter()
            outs = [o for group in groups for o in llm.generate(group, params)]
            t = totals[arm]
            t["seconds"] += time.perf_counter() - start
            t["tokens"] += sum(len(o.token_ids) for o in outs)
            t["quiet"] += engine.stats.spec.quiet_steps - quiet_before
            t["drafts"] += sum(o.spec.num_draft_tokens for o in outs)
            t["accepted"] += sum(o.spec.num_accepted_tokens for o in outs)
            print(f"round {r} {arm}: {sum(o.spec.num_draft_tokens for o in outs)} drafts", flush=True)
            got = [o.token_ids for o in outs]
            if tokens.setdefault(arm, got) != got:
                print(f"round {r}: {arm} tokens differ from its first round")
            engine.stats.drain_events()
    same = tokens["quiet spells"] == tokens["weigh every step"]
    print(f"{batch} request(s) at a time; the arms' tokens {'the same' if same else 'DIFFER'}")
    print(f"{'arm':18s} {'tok/s':>7s} {'quiet steps':>11s} {'drafts':>7s} {'accepted':>8s}")
    for arm, t in totals.items():
        print(
            f"{arm:18s} {t['tokens'] / t['seconds']:7.2f} {t['quiet']:11d} {t['drafts']:7d} {t['accepted']:8d}"
        )
    print(
        f"speed, quiet spells / weigh every step: {totals['weigh every step']['seconds'] / totals['quiet spells']['seconds']:.3f}"
    )


if __name__ == "__main__":
    main()
