"""The bench_quantization code prompt, 128 greedy tokens of the bf16 Qwen2.5-Coder-1.5B target: plain
against speculation with the int4 0.5B draft (int8 activations), without and with `--batch-invariant`.
Without it a verification window's bf16 rows may round apart from one-row decodes (README,
"Batch-invariant numerics"); with it the output must match token for token.

    python bf16_spec_vs_plain.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.benchmarks.bench_quantization import CODE_PROMPT
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams


def main() -> None:
    p = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    msgs = [{"role": "user", "content": CODE_PROMPT}]
    for bi in (False, True):
        plain = LLM("Qwen/Qwen2.5-Coder-1.5B-Instruct", speculative_method="none", batch_invariant=bi)
        a = plain.generate([msgs], p)[0].token_ids
        del plain
        spec = LLM(
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            speculative_method="draft_model",
            draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            draft_quantization_encoding="int4",
            batch_invariant=bi,
        )
        b = spec.generate([msgs], p)[0].token_ids
        del spec
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        print(f"batch_invariant={bi}: spec == plain: {a == b} (first difference at token {first})")


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(1) as w:
        w.submit(main).result()
