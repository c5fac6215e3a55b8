"""RoPE's tables gathered once a forward and its sign folded into them (engine/models/rope.py) against
the previous forward (gathered, cast and rotated in every layer), alternated in one process: a draft
step of the Qwen2.5-0.5B int4 draft (loaded as a draft) for 1 and 4 sequences, and a one-row decode
of the SmolLM2-135M bf16 default model; the hidden states of both arms compared bit for bit.

    python rope_tables.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.models.rope import RotaryEmbedding
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200
NEW_FORWARD = RotaryEmbedding.forward


UNSIGNED: dict[int, torch.Tensor] = {}  # id(module) -> the previous sin table, built once


def previous_forward(self, positions, q, k):  # the forward before this session's change
    half = self.sin.shape[-1] // 2
    unsigned = UNSIGNED.get(id(self))
    if unsigned is None:
        unsigned = UNSIGNED[id(self)] = torch.cat([self.sin[:, half:], self.sin[:, half:]], dim=-1)
    cos = self.cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
    sin = unsigned.index_select(0, positions).unsqueeze(1).to(q.dtype)

    def rotate_half(x):
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def bench(name: str, spec: ModelSpec, draft: bool, num_seqs: int, rounds: int) -> None:
    model = load_model(spec, None, draft=draft).model.eval()
    kv = model.allocate_kv_cache(64 * BLOCK * num_seqs + 1, spec.dtype, "cpu")
    tables = [list(range(64 * i, 64 * (i + 1))) for i in range(num_seqs)]
    forward_sequences(
        model, kv, [SequenceInput(list(range(100, 100 + CONTEXT)), 0, t, 1) for t in tables], BLOCK
    )
    seqs = [SequenceInput([5], CONTEXT, t, 1) for t in tables]

    def step() -> torch.Tensor:
        return forward_sequences(model, kv, seqs, BLOCK)

    arms = {"previous": previous_forward, "now": NEW_FORWARD}
    outputs = {}
    for arm, forward in arms.items():
        RotaryEmbedding.forward = forward
        outputs[arm] = model.compute_logits(step())
    same = torch.equal(outputs["previous"], outputs["now"])
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm, forward in arms.items():
            RotaryEmbedding.forward = forward
            start = time.perf_counter()
            model.compute_logits(step()).argmax(-1)
            times[arm].append(time.perf_counter() - start)
    RotaryEmbedding.forward = NEW_FORWARD
    before, after = (statistics.median(times[a]) * 1e3 for a in arms)
    print(
        f"{name}, {num_seqs} sequence(s): previous {before:.2f} ms, now {after:.2f} ms, "
        f"now / previous {after / before:.3f}; logits bit for bit the same: {same}"
    )


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    draft = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    for n in (1, 4):
        bench("Qwen2.5-Coder-0.5B int4 draft step", draft, True, n, rounds)
    bench("SmolLM2-135M bf16 decode", ModelSpec(), False, 1, rounds)


if __name__ == "__main__":
    # One worker thread, as the engine runs its forwards.
    ThreadPoolExecutor(1).submit(main).result()
