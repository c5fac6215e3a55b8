"""Prototype (not in the engine): split a group of decodes in two by context length, each part padded to
its own longest context, and time plain 8-sequence forwards with and without the split, taking turns in
one process. The split point minimises the padded keys (k x the k-th shortest + the rest x the longest),
taken only where it saves at least a tenth of them (on the 50..350 layout it saves 24%). Layouts as in spread.py.

    python docs/bench/issue20-context-spread-s32/split_ab.py [rounds] [mean] [width]
"""

import statistics as st
import sys

from specserve.engine import LLM, SamplingParams
from specserve.engine.attention import AttentionMetadata, query_groups

original_build = AttentionMetadata.build.__func__
state = {"split": False, "inside": False}


def split_by_context(members: list[int], context_lens: list[int]) -> list[list[int]]:
    order = sorted(members, key=lambda i: context_lens[i])
    lengths = [context_lens[i] for i in order]
    whole = len(order) * lengths[-1]
    best, cut = whole, 0
    for k in range(1, len(order)):
        padded = k * lengths[k - 1] + (len(order) - k) * lengths[-1]
        if padded < best:
            best, cut = padded, k
    if best > 0.9 * whole:
        return [members]
    return [sorted(order[:cut]), sorted(order[cut:])]


def build(
    cls, query_lens, context_lens, block_tables, block_size, device="cpu", pad_slot=0, context_starts=None
):
    if state["split"] and not state["inside"]:
        groups = []
        for members in query_groups(query_lens):
            decodes = len(members) > 1 and query_lens[members[0]] == 1
            groups += split_by_context(members, context_lens) if decodes else [members]
        if len(groups) > 1:
            state["inside"] = True
            try:
                return cls._grouped(
                    groups,
                    query_lens,
                    context_lens,
                    block_tables,
                    block_size,
                    device,
                    pad_slot,
                    context_starts,
                )
            finally:
                state["inside"] = False
    return original_build(
        cls, query_lens, context_lens, block_tables, block_size, device, pad_slot, context_starts
    )


AttentionMetadata.build = classmethod(build)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
mean = int(sys.argv[2]) if len(sys.argv) > 2 else 200
width = int(sys.argv[3]) if len(sys.argv) > 3 else 150
llm = LLM(None, max_batch_size=8)
filler = llm.tokenizer.encode(" the quick brown fox jumps over the lazy dog" * 200)
lengths = [mean - width + round(2 * width * i / 7) for i in range(8)]
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculative_enabled=False)
print("contexts", lengths, flush=True)
results: dict[bool, list[float]] = {False: [], True: []}
texts: dict[bool, list[list[int]]] = {}
for r in range(rounds + 1):
    for split in (False, True) if r % 2 == 0 else (True, False):
        state["split"] = split
        prompts = [filler[r + i : r + i + n] for i, n in enumerate(lengths)]
        llm.engine.stats.drain_events()
        outputs = llm.generate(prompts, [params] * 8, use_chat_template=False)
        texts.setdefault(split, []).append([o.token_ids for o in outputs])
        steps = llm.engine.stats.drain_events().steps
        plain = [s.forward_seconds for s in steps if s.prefill_tokens == 0 and s.num_sequences == 8]
        print(
            f"round {r} split={split!s:5} plain@8 {1e3 * st.median(plain):5.2f} ms over {len(plain)}",
            flush=True,
        )
        if r:
            results[split].append(st.median(plain))
ratios = [a / b for a, b in zip(results[True], results[False], strict=True)]
print("split / padded per round:", " ".join(f"{x:.3f}" for x in ratios), f"(median {st.median(ratios):.3f})")
same = sum(a == b for a, b in zip(texts[True], texts[False], strict=True))
print(f"greedy outputs equal in {same} of {len(texts[True])} rounds (bf16: padding can move a rounding)")
