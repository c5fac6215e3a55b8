"""What a draft LM head over part of the vocabulary would save: the int4 Qwen2.5-Coder-0.5B draft
(loaded as the server loads a draft), one draft step at 1 and 4 sequences of 256 cached tokens, with
its LM head over all 151,936 tokens and over a subset of N rows (the same int4 codes and scales,
regathered in the kernel's tiled layout; logits scattered back into a [rows, vocab] table of -inf, as
a proposer would need them). Alternated, median of REPEATS.

    python draft_vocab_head.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.int4_kernel import TILE
from specserve.engine.quantization import Int4TiledLinear
from specserve.engine.row_routed_linear import RowRoutedLinear
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT, SUBSETS = 16, 256, (16384, 32768)


def tiled_rows(layer: Int4TiledLinear, ids: torch.Tensor) -> Int4TiledLinear:
    """The layer's output rows `ids` only, same codes and scales (tiles [T, K/8, 16], [T, G, 2, 16])."""
    t, k8, _ = layer.qweight.shape
    rows_q = layer.qweight.permute(0, 2, 1).reshape(t * TILE, k8)[ids]  # [S, K/8]
    sz = layer.scales_and_zeros
    rows_sz = sz.permute(0, 3, 1, 2).reshape(t * TILE, sz.shape[1], 2)[ids]  # [S, G, 2]
    pad = -len(ids) % TILE
    rows_q = nn.functional.pad(rows_q, (0, 0, 0, pad))
    rows_sz = nn.functional.pad(rows_sz, (0, 0, 0, 0, 0, pad))
    tiles = rows_q.shape[0] // TILE
    q = rows_q.reshape(tiles, TILE, k8).permute(0, 2, 1).contiguous()
    s = rows_sz.reshape(tiles, TILE, sz.shape[1], 2).permute(0, 2, 3, 1).contiguous()
    out = Int4TiledLinear(q, s, layer.group_size, len(ids), None, layer.kernel)
    out.int8_activations = layer.int8_activations
    return out


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    torch.set_num_threads(2)
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    model = load_model(spec, None, draft=True).model.eval()
    head = model.lm_head
    quantized = head.quantized if isinstance(head, RowRoutedLinear) else head
    print("lm_head:", type(head).__name__, quantized)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    subsets = {n: torch.randperm(vocab, generator=gen)[:n].sort().values for n in SUBSETS}
    heads = {n: tiled_rows(quantized, ids) for n, ids in subsets.items()}
    x = torch.randn(4, quantized.in_features, dtype=torch.bfloat16)
    for n, ids in subsets.items():  # the regathered rows compute the same numbers
        torch.testing.assert_close(heads[n](x), quantized(x)[:, ids], rtol=0, atol=0)
    blocks = CONTEXT // BLOCK + 2
    kv = model.allocate_kv_cache(4 * blocks * BLOCK + 1, torch.bfloat16, "cpu")
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(4)]
    prompt = [(7 * i) % 5000 + 100 for i in range(CONTEXT)]
    with torch.inference_mode():
        for table in tables:
            forward_sequences(model, kv, [SequenceInput(prompt, 0, table, 1)], BLOCK)

    def step(rows: int, n: int | None) -> float:
        seqs = [SequenceInput([42], CONTEXT, tables[i], 1) for i in range(rows)]
        start = time.perf_counter()
        with torch.inference_mode():
            hidden = forward_sequences(model, kv, seqs, BLOCK)
            if n is None:
                logits = model.compute_logits(hidden)  # [rows, V]
            else:
                logits = torch.full((rows, vocab), -torch.inf)
                logits[:, subsets[n]] = heads[n](hidden).float()
            logits.argmax(dim=-1).tolist()
        return time.perf_counter() - start

    def head_only(rows: int, n: int | None) -> float:
        h = torch.randn(rows, quantized.in_features, dtype=torch.bfloat16)
        start = time.perf_counter()
        with torch.inference_mode():
            (quantized if n is None else heads[n])(h)
        return time.perf_counter() - start

    arms: list[int | None] = [None, *SUBSETS]
    for rows in (1, 4):
        for name, fn in (("draft step", step), ("LM head alone", head_only)):
            times: dict[int | None, list[float]] = {a: [] for a in arms}
            for _ in range(3):
                for a in arms:
                    fn(rows, a)
            for _ in range(repeats):
                for a in arms:
                    times[a].append(fn(rows, a))
            med = {a: statistics.median(t) * 1e3 for a, t in times.items()}
            print(
                f"{rows} seq {name:14s} all {vocab}: {med[None]:6.2f} ms  "
                + "  ".join(f"{n}: {med[n]:6.2f} ms ({med[n] / med[None]:.3f})" for n in SUBSETS)
            )


if __name__ == "__main__":
    main()
