"""Structured output on the real embedded SmolLM2-135M-Instruct (float32): every response parses and
validates against its schema, and greedy output is token for token the same with speculation off,
n-gram and a draft model. Slow (minutes of decoding on 2 cores): the default suite covers the same
mechanics on tiny models (test_structured_output.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from specserve.engine import LLM, SamplingParams
from specserve.engine.models.loader import resolve_model
from specserve.engine.sampling_params import StructuredOutput

SCHEMAS = json.loads((Path(__file__).parents[2] / "benchmarks/prompts/json_schemas.json").read_text())
QUICK = ["person", "weather", "array_of_objects", "status_with_code"]


def _prompt(name: str) -> list[dict[str, str]]:
    schema = json.dumps(SCHEMAS[name])
    return [
        {"role": "user", "content": f"Give an example {name.replace('_', ' ')} as JSON matching: {schema}"}
    ]


def _run(names: list[str], **engine_kwargs) -> list:
    engine_kwargs.setdefault("speculative_method", "none")
    llm = LLM(
        None,
        quantization_encoding="float32",
        max_kv_cache_tokens=8192,
        speculative_policy="static",
        **engine_kwargs,
    )
    params = [
        SamplingParams(
            max_tokens=160,
            temperature=0,
            structured_output=StructuredOutput("json_schema", json.dumps(SCHEMAS[n])),
        )
        for n in names
    ]
    return llm.generate([_prompt(n) for n in names], params)


def _check(names: list[str], modes: dict[str, dict]) -> None:
    outputs = {mode: _run(names, **kwargs) for mode, kwargs in modes.items()}
    plain = outputs["off"]
    for name, out in zip(names, plain, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    for mode, outs in outputs.items():
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], mode
    assert sum(o.spec.num_forced_tokens for o in outputs["ngram"]) > 0


@pytest.mark.slow
def test_smollm2_structured_output_validates_and_speculation_changes_nothing():
    _check(QUICK, {"off": {}, "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4}})


@pytest.mark.slow
def test_smollm2_all_schemas_off_ngram_draft_model():
    draft = {
        "speculative_method": "draft_model",
        "draft_model_path": str(resolve_model(None).directory),  # the embedded model again, as an int4 draft
        "draft_quantization_encoding": "int4",
        "num_speculative_tokens": 4,
    }
    modes = {"off": {}, "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4}, "draft": draft}
    _check(sorted(SCHEMAS), modes)
