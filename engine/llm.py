"""Offline API: `LLM(model_path=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .config import EngineConfig, ModelSpec
from .engine_core import EngineCore
from .outputs import TokenLogprob
from .sampling_params import SamplingParams
from .stats import SpecDecodingStats

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    elapsed_s: float = 0.0
    first_token_s: float | None = None
    error: str | None = None


class LLM:
    def __init__(self, model_path: str | None = None, config: EngineConfig | None = None, **kwargs: Any):
        if config is None:
            model_keys = {"weight_path", "quantization_encoding", "devices", "int4_group_size"}
            model = ModelSpec(
                model_path=model_path, **{k: kwargs.pop(k) for k in list(kwargs) if k in model_keys}
            )
            draft_path = kwargs.pop("draft_model_path", None)
            # The draft may use its own encoding (e.g. an int4 draft for a bfloat16 target).
            draft_encoding = kwargs.pop("draft_quantization_encoding", None) or model.quantization_encoding
            draft_group = kwargs.pop("draft_int4_group_size", None) or model.int4_group_size
            draft = (
                ModelSpec(
                    model_path=draft_path, quantization_encoding=draft_encoding, int4_group_size=draft_group
                )
                if draft_path
                else None
            )
            config = EngineConfig(model=model, draft=draft, **kwargs)
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer

    def encode_prompt(self, prompt: Prompt, use_chat_template: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if use_chat_template and self.tokenizer.has_chat_template:
                return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        return [int(t) for t in prompt]  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_chat_template: bool = True,
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, CompletionOutput] = {}
        order: list[str] = []
        start = time.perf_counter()
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self.encode_prompt(prompt, use_chat_template)  # type: ignore[arg-type]
            req = self.engine.make_request(ids, p)
            order.append(req.request_id)
            results[req.request_id] = CompletionOutput("", [], None, ids, spec=req.spec)
            self.engine.add_request(req)
        while self.engine.has_work():
            for out in self.engine.step():
                res = results[out.request_id]
                if out.new_token_ids and res.first_token_s is None:
                    res.first_token_s = time.perf_counter() - start
                res.text += out.new_text
                res.token_ids += out.new_token_ids
                res.logprobs += out.new_logprobs
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.error = out.error
                    res.elapsed_s = time.perf_counter() - start
        return [results[r] for r in order]
