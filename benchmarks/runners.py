"""One timed greedy generation per engine, from prompt token ids: the batch-1 runners that `bench latency`
measures (specserve, transformers) and whose result type the llama.cpp peer returns too."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# The methods `bench latency` compares, by engine family: <engine>:<proposer>.
SS_PLAIN, SS_NGRAM, SS_DRAFT = "specserve:plain", "specserve:ngram", "specserve:draft_model"
HF_PLAIN, HF_ASSISTED, HF_LOOKUP = "transformers:plain", "transformers:assisted", "transformers:prompt_lookup"
LC_PLAIN = "llama.cpp:plain"  # llama-cpp-python on the target's GGUF (llama_cpp_peer)


@dataclass
class RunResult:
    token_ids: list[int]
    elapsed_s: float
    first_token_s: float | None
    num_steps: int | None = None  # target forwards that emitted tokens (transformers: streamer puts)
    spec: dict[str, Any] | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    text: str | None = None  # specserve only: what --response-format validates
    finish_reason: str | None = None
    grammar_s: float | None = None  # structured output: the matcher's time (masks, draft checks, commits)

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 and self.token_ids else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        n = len(self.token_ids) - 1
        if self.first_token_s is None or n <= 0:
            return None
        dt = self.elapsed_s - self.first_token_s
        return n / dt if dt > 0 else None


class SpecserveRunner:
    """One specserve engine; `speculate=False` runs the same engine with speculation off per request."""

    def __init__(self, llm: Any, speculate: bool):
        self.llm = llm
        self.speculate = speculate

    def _params(self, max_new_tokens: int, ignore_eos: bool, structured_output: Any = None) -> Any:
        from specserve.engine import SamplingParams

        return SamplingParams(
            max_tokens=max_new_tokens,
            temperature=0.0,
            ignore_eos=ignore_eos,
            speculative_enabled=self.speculate,
            structured_output=structured_output,
        )

    def run(
        self, ids: list[int], max_new_tokens: int, ignore_eos: bool, structured_output: Any = None
    ) -> RunResult:
        """One request; `structured_output` (a StructuredOutput) constrains it. A complete grammar ends
        the request even with EOS ignored, so constrained runs may generate fewer than max_new_tokens."""
        eng = self.llm.engine.stats.spec
        # Engine counters are read before and after: the engine sums a request's grammar time when it
        # finishes, and runs one request at a time here, so the difference is this request's.
        d0, v0, g0 = eng.draft_seconds, eng.verify_seconds, eng.grammar_seconds
        out = self.llm.generate([ids], self._params(max_new_tokens, ignore_eos, structured_output))[0]
        if out.error:
            raise RuntimeError(f"specserve request failed: {out.error}")
        spec = None
        if self.speculate:
            s = out.spec
            spec = {
                "num_drafts": s.num_drafts,
                "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
                "accepted_per_position": list(s.accepted_per_position),
                "num_forced_tokens": s.num_forced_tokens,
            }
        return RunResult(
            list(out.token_ids),
            out.elapsed_s,
            out.first_token_s,
            None,
            spec,
            eng.draft_seconds - d0 if self.speculate else None,
            eng.verify_seconds - v0 if self.speculate else None,
            out.text,
            out.finish_reason,
            eng.grammar_seconds - g0 if structured_output is not None else None,
        )

    def run_batch(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        ignore_eos: bool,
        structured_outputs: list[Any] | None = None,
    ) -> tuple[int, float]:
        """(generated tokens, seconds) for prompts submitted together, each with its own constraint."""
        constraints = structured_outputs or [None] * len(batch)
        params = [self._params(max_new_tokens, ignore_eos, so) for so in constraints]
        t0 = time.perf_counter()
        outs = self.llm.generate(batch, params)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


class _TimingStreamer:
    """transformers streamer that only records when each chunk of new tokens arrived."""

    def __init__(self) -> None:
        self.times: list[tuple[float, int]] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:  # generate() first puts the prompt
            self._seen_prompt = True
            return
        self.times.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


class TransformersRunner:
    def __init__(self, model: Any, extra: dict[str, Any]):
        self.model = model
        self.extra = extra

    def run(self, ids: list[int], max_new_tokens: int, ignore_eos: bool) -> RunResult:
        import copy

        import torch

        gc = copy.deepcopy(self.model.generation_config)
        gc.max_new_tokens = max_new_tokens
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        if gc.pad_token_id is None:
            eos = gc.eos_token_id
            gc.pad_token_id = eos[0] if isinstance(eos, list) else eos
        if ignore_eos:
            gc.eos_token_id = None
        for k, v in self.extra.items():
            if k != "assistant_model":
                setattr(gc, k, v)
        input_ids = torch.tensor([ids], dtype=torch.long)
        streamer = _TimingStreamer()
        kwargs = {"assistant_model": self.extra["assistant_model"]} if "assistant_model" in self.extra else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gc,
                streamer=streamer,
                **kwargs,
            )
        elapsed = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        first = streamer.times[0][0] - t0 if streamer.times else None
        return RunResult(new, elapsed, first, len(streamer.times))
