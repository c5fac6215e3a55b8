"""Structured output in the engine: every mode emits what the grammar admits, speculation changes no
greedy token, sampled output is exactly the constrained target distribution, forced tokens are free
drafts, and bad or dead grammars end cleanly."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import build_tokenizer, make_adaptive_llm, make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.engine_core import EngineCore
from specserve.engine.grammar import GrammarCompiler
from specserve.engine.random_streams import RequestRandom
from specserve.engine.request import Request
from specserve.engine.sampling_params import InvalidParameterError, StructuredOutput
from specserve.engine.step_batch import Draft
from specserve.engine.verifier import Window, verify_windows

SCHEMAS = json.loads((Path(__file__).parents[2] / "benchmarks/prompts/json_schemas.json").read_text())


def _json_params(schema: dict, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 96)
    kwargs.setdefault("temperature", 0)
    return SamplingParams(structured_output=StructuredOutput("json_schema", json.dumps(schema)), **kwargs)


def _speculative(method: str, request) -> dict:
    if method == "draft_model":
        return {
            "speculative_method": "draft_model",
            "draft_model_path": str(request.getfixturevalue("tiny_draft_dir")),
        }
    return {"speculative_method": method}


@pytest.fixture(scope="module")
def schema_prompts():
    names = sorted(SCHEMAS)
    return names, mixed_prompts(len(names), seed=3)


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir, schema_prompts):
    names, prompts = schema_prompts
    llm = make_llm(tiny_llama_dir)
    params = [_json_params(SCHEMAS[n]) for n in names]
    return llm.generate(prompts, params, use_chat_template=False)


def test_every_finished_output_validates(plain_outputs, schema_prompts):
    names, _ = schema_prompts
    finished = 0
    for name, out in zip(names, plain_outputs, strict=True):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
            finished += 1
    # A random-weight model still completes most bounded schemas: the grammar drives it to the end.
    assert finished >= len(names) * 3 // 4, [o.finish_reason for o in plain_outputs]


@pytest.mark.parametrize("policy", ["static", "adaptive"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "ngram,draft_model"])
def test_greedy_structured_output_is_the_same_with_speculation(
    tiny_llama_dir, schema_prompts, plain_outputs, method, policy, request
):
    names, prompts = schema_prompts
    kwargs = {"num_speculative_tokens": 4, **_speculative(method, request)}
    if method == "ngram,draft_model":
        kwargs["draft_model_path"] = str(request.getfixturevalue("tiny_draft_dir"))
        kwargs["speculative_method"] = method
    llm = (
        make_adaptive_llm(tiny_llama_dir, **kwargs)
        if policy == "adaptive"
        else make_llm(tiny_llama_dir, **kwargs)
    )
    outs = llm.generate(prompts, [_json_params(SCHEMAS[n]) for n in names], use_chat_template=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outputs]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain_outputs]
    # The grammar's forced tokens (punctuation, key names) went out as drafts and were counted.
    assert sum(o.spec.num_forced_tokens for o in outs) > 0
    assert llm.engine.stats.spec.num_forced_tokens == sum(o.spec.num_forced_tokens for o in outs)


def test_greedy_regex_and_lark_with_speculation(tiny_llama_dir):
    prompts = mixed_prompts(4, seed=5)
    constraints = [
        StructuredOutput("regex", r"(ab|cd){2,6}x"),
        StructuredOutput("lark", 'start: "yes" | "no" | /[0-9]{1,3}/'),
    ]
    for so in constraints:
        params = SamplingParams(max_tokens=40, temperature=0, structured_output=so)
        plain = make_llm(tiny_llama_dir).generate(prompts, params, use_chat_template=False)
        spec = make_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=4).generate(
            prompts, params, use_chat_template=False
        )
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        for out in plain:
            assert out.finish_reason == "stop"
            if so.kind == "regex":
                assert out.text.endswith("x") and set(out.text[:-1]) <= set("abcd")
            else:
                assert out.text in ("yes", "no") or (out.text.isdigit() and len(out.text) <= 3)


def test_constrained_sampling_with_cut_drafts_is_exact(tmp_path):
    """Drafts drawn from a q that puts half its mass on tokens the grammar forbids: the emitted token
    must follow the masked target distribution. The cut draft's residual is what keeps it exact;
    drawing the bonus from p at the cut (the tempting shortcut) is biased, and this test sees it."""
    tok = build_tokenizer(tmp_path)
    vocab = len(tok)
    compiler = GrammarCompiler(tok, vocab, frozenset({tok.eos_token_id}))
    grammar = compiler.matcher(StructuredOutput("regex", "[a-f]+"))
    allowed = grammar.allowed()  # [V]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=gen) * 2  # [2, V]: p_0 and the row after the draft
    p0 = torch.softmax(logits[0].masked_fill(~allowed, float("-inf")), -1)  # the constrained target
    q = torch.rand(vocab, generator=gen) ** 4
    q[allowed] *= q[~allowed].sum() / q[allowed].sum()  # half of q's mass on forbidden tokens
    q /= q.sum()
    params = SamplingParams(max_tokens=8, temperature=1.0)
    request = Request("r", [5, 6, 7], params)
    trials, chunk = 20000, 500
    draws = torch.multinomial(q, trials, replacement=True, generator=gen).tolist()
    exact, shortcut = torch.zeros(vocab), torch.zeros(vocab)
    for start in range(0, trials, chunk):  # one verification batch per chunk of trials
        windows, rows = [], []
        for i in range(start, start + chunk):
            draft = EngineCore._constrain(grammar, Draft([draws[i]], q.unsqueeze(0)), k=1)
            masks = grammar.window_masks(draft.token_ids)
            windows.append(Window(request, draft.token_ids, draft.probs, RequestRandom(i), masks, draft.cut))
            rows.append(logits[: len(draft.token_ids) + 1])
        for counts in (exact, shortcut):
            for emitted in verify_windows(torch.cat(rows), windows):
                counts[emitted[0]] += 1
            for w in windows:
                w.cut_draft = None  # second pass: the shortcut
    assert exact[~allowed].sum() == 0
    support = p0 > 0
    expected = p0[support] * trials
    assert chisquare(exact[support], expected).pvalue > 1e-3
    assert chisquare(shortcut[support], expected).pvalue < 1e-6


def test_sampled_structured_output_with_speculation_stays_in_grammar(tiny_llama_dir, request):
    schema = SCHEMAS["event"]
    llm = make_llm(tiny_llama_dir, num_speculative_tokens=4, **_speculative("draft_model", request))
    outs = llm.generate(
        mixed_prompts(8, seed=9),
        [_json_params(schema, temperature=1.0, seed=i) for i in range(8)],
        use_chat_template=False,
    )
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert any(o.finish_reason == "stop" for o in outs)


def test_invalid_grammars_are_parameter_errors(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    bad = [
        StructuredOutput("json_schema", json.dumps({"type": "no-such-type"})),
        StructuredOutput("json_schema", "{not json"),
        StructuredOutput("regex", "(unclosed"),
        StructuredOutput("lark", "start: undefined_rule"),
        StructuredOutput("json_schema", "[1, 2]", param="tool_choice"),
    ]
    for so in bad:
        with pytest.raises(InvalidParameterError) as err:
            llm.engine.make_request([1, 2, 3], SamplingParams(structured_output=so))
        assert err.value.param == so.param
    assert not llm.engine.has_work()


def test_dead_end_grammar_finishes_with_stop(tiny_llama_dir, caplog):
    """A matcher that can go no further (here: forced into an error) stops its request cleanly, with a
    warning, and the request next to it is untouched."""
    llm = make_llm(tiny_llama_dir)
    engine = llm.engine
    so = StructuredOutput("regex", "[a-z]{40}")
    stuck = engine.make_request([3, 4, 5], SamplingParams(max_tokens=30, temperature=0, structured_output=so))
    other = engine.make_request([3, 4, 5], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.add_request(stuck)
    engine.add_request(other)
    engine.step()  # prefill; both sample a first token
    assert not stuck.grammar.commit(engine.tokenizer.encode("7"))  # a digit: [a-z] forbids it
    finished = {}
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        for _ in range(20):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_work():
                break
    assert finished[stuck.request_id].finish_reason == "stop"
    assert finished[stuck.request_id].error is None
    assert finished[other.request_id].finish_reason == "length"
    assert "grammar admits no continuation" in caplog.text
