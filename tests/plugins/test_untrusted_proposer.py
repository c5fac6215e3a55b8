"""A proposer is untrusted code: a bad proposal costs only its own request its drafts (issue 18, item 3)."""

from __future__ import annotations

import logging

from tiny_models import make_llm

from specserve.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)


def _prompts() -> list[list[int]]:
    # First tokens 30..41 cover every fault kind (first token % 6) twice.
    return [[30 + i, 5, 6, 7, 5, 6, 7, 5] for i in range(12)]


def test_bad_proposals_drop_only_their_drafts(tiny_llama_dir, broken_plugin_entry_point, caplog):
    prompts = _prompts()
    plain = make_llm(tiny_llama_dir)
    broken = make_llm(tiny_llama_dir, speculative_method=broken_plugin_entry_point, num_speculative_tokens=3)
    with caplog.at_level(logging.ERROR, logger="specserve.engine"):
        for params in (GREEDY, SAMPLED):
            want = [o.token_ids for o in plain.generate(prompts, params, use_chat_template=False)]
            outs = broken.generate(prompts, params, use_chat_template=False)
            if params is GREEDY:
                assert [o.token_ids for o in outs] == want
            assert all(o.finish_reason == "length" and o.error is None for o in outs)
            for prompt, out in zip(prompts, outs, strict=True):
                valid = prompt[0] % 6 == 5
                assert (out.spec.num_draft_tokens > 0) == valid, (prompt[0], out.spec)
    # Every malformed proposal was counted; the log names the first one, once.
    assert broken.engine.stats.spec.proposer_errors >= 10 * 16
    lines = [r.getMessage() for r in caplog.records if "invalid proposal" in r.getMessage()]
    assert len(lines) == 1 and "broken" in lines[0]
