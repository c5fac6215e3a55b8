"""The hybrid proposer's look ahead: an n-gram match it would use is planned a step early and reported
as its own class (proposer and match length), so the controller chooses k from what that class gets
accepted; a request without a usable match is planned for the draft model. Propose keeps to the plan."""

from __future__ import annotations

from tiny_models import make_adaptive_llm, make_llm, mixed_prompts

from specserve.engine import SamplingParams
from specserve.engine.hybrid_proposer import HINT_STRIDE
from specserve.engine.proposer import ProposalRequest
from specserve.engine.request import Request
from specserve.engine.spec_controller import Preview

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _request(ids: list[int], rid: str = "r") -> Request:
    req = Request(rid, ids[:-1], SamplingParams(max_tokens=8))
    req.output_token_ids = ids[-1:]
    return req


def _hybrid(tiny_llama_dir, tiny_draft_dir):
    return make_adaptive_llm(
        tiny_llama_dir,
        speculative_method="ngram,draft_model",
        draft_model_path=str(tiny_draft_dir),
        num_speculative_tokens=4,
    )


def test_preview_plans_the_proposer_and_propose_keeps_to_it(tiny_llama_dir, tiny_draft_dir):
    hybrid = _hybrid(tiny_llama_dir, tiny_draft_dir).engine.proposer
    matched = _request([1, 2, 3, 9, 5, 1, 2, 3], "matched")  # "1 2 3" seen before: 9 5 1 2 follow
    assert hybrid.preview(matched, 4) == Preview(4, 0 * HINT_STRIDE + 3, (9, 5, 1, 2), free=True)
    # Even if the n-gram's rate fell between preview and propose, the drafts are the planned ones.
    hybrid._requests["matched"].rates[0] = 0.0
    out = hybrid.propose([ProposalRequest(matched, 2)])
    assert out.token_ids == [[9, 5]] and out.probs == [None]

    unmatched = _request([1, 2, 3, 4], "unmatched")
    # The draft model, its one class; it first feeds the tokens it has not seen, and ends a window
    # where its chain turns unsure.
    assert hybrid.preview(unmatched, 4) == Preview(
        4, 1 * HINT_STRIDE, setup_tokens=unmatched.num_tokens, stops_unsure=True
    )

    # Two n-gram drafts are worth less than the draft model's 4 at equal rates: the draft model is
    # planned although there is a match; once the draft model's own rate is low, the match is.
    weak = _request([7, 8, 7], "weak")
    assert hybrid.preview(weak, 4) == Preview(
        4, 1 * HINT_STRIDE, setup_tokens=weak.num_tokens, stops_unsure=True
    )
    hybrid._requests["weak"].rates[1] = 0.1
    # n-gram (index 0): "7" matched, "8 7" follow
    assert hybrid.preview(weak, 4) == Preview(2, 1, (8, 7), free=True)
    # Unplanned requests (static policy: never previewed) are decided in propose, as before.
    static = _request([1, 2, 3, 9, 5, 1, 2, 3], "static")
    assert hybrid.propose([ProposalRequest(static, 2)]).token_ids == [[9, 5]]
    # The draft model's drafts for a planned request (it needs the request's KV blocks, so a real
    # engine run): test_adaptive_hybrid_learns_each_class_and_stays_lossless.


def test_adaptive_hybrid_learns_each_class_and_stays_lossless(tiny_llama_dir, tiny_draft_dir):
    prompts = mixed_prompts(16, seed=3)
    want = [o.token_ids for o in make_llm(tiny_llama_dir).generate(prompts, GREEDY, use_chat_template=False)]
    llm = _hybrid(tiny_llama_dir, tiny_draft_dir)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_chat_template=False)]
    assert got == want
    acceptance = llm.engine.controller.acceptance
    initial = acceptance.global_rates(hint=-1)  # a class nobody has seen
    ngram_classes = [h for h in range(1, 5) if acceptance.global_rates(hint=h) != initial]
    assert ngram_classes, "no n-gram match-length class got verifications"
    assert acceptance.global_rates(hint=HINT_STRIDE) != initial, "the draft model's class got none"
    assert acceptance.global_rates(hint=None) == initial  # every proposal had its class
