"""What the controller's chosen drafts delivered against its expectation, by n-gram class and k, at
batch 1 (SmolLM2 bf16, 21 prompts x 2 passes, 64 tokens). Usage: python calib.py new|old"""

import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch1 import build_llm, old_controller  # noqa: E402

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.engine import SamplingParams  # noqa: E402
from specserve.engine.acceptance_model import expected_tokens  # noqa: E402

llm = build_llm()
eng = llm.engine
if len(sys.argv) > 1 and sys.argv[1] == "old":
    eng.controller = eng.scheduler.controller = old_controller(eng)
ctrl = eng.controller
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 3)]
pending: dict[str, tuple] = {}
stats: dict[tuple, list[tuple[float, int]]] = defaultdict(list)
choose, observe = ctrl.choose, ctrl.observe_verification


def recording_choose(candidates, *args):
    decision = choose(candidates, *args)
    for c in candidates:
        k = decision.k[c.request_id]
        if k > 0 and c.request_id not in decision.probed:
            pending[c.request_id] = (c.hint, k, ctrl._chosen.get(c.request_id, (None,))[0])
    return decision


def recording_observe(request_id, num_drafts, num_accepted, emitted=()):
    chosen = pending.pop(request_id, None)
    if chosen and num_drafts > 0 and chosen[2] is not None:
        hint, k, rates = chosen
        stats[(hint, min(k, 4))].append((expected_tokens(rates, num_drafts) - 1, num_accepted))
    return observe(request_id, num_drafts, num_accepted, emitted)


ctrl.choose, ctrl.observe_verification = recording_choose, recording_observe
for _ in range(2):
    for prompt in prompts:
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        llm.generate([prompt], params, use_chat_template=False)
total_expected = total_accepted = 0.0
for key in sorted(stats, key=str):
    rows = stats[key]
    expected = sum(e for e, _ in rows)
    accepted = sum(a for _, a in rows)
    total_expected += expected
    total_accepted += accepted
    print(key, f"n {len(rows)} expected {expected:.1f} accepted {accepted} ratio {accepted / expected:.2f}")
print(
    f"total expected {total_expected:.1f} accepted {total_accepted:.0f} ratio {total_accepted / total_expected:.2f}"
)
