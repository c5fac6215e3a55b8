"""One request's non-finite numbers never reach another request of the same batch (issue 18, item 2)."""

from __future__ import annotations

import torch
from tiny_models import make_llm

from specserve.engine import SamplingParams

LONG = list(range(10, 70))  # 60 tokens: owns the first KV blocks
SHORT = [7, 8, 9, 10, 11]  # its attention is padded up to LONG's context length


def _run_to_end(core, ids: list[str]) -> dict[str, dict]:
    results = {rid: {"tokens": [], "reason": None, "error": None} for rid in ids}
    for _ in range(200):
        for out in core.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            if out.finished:
                r["reason"], r["error"] = out.finish_reason, out.error
        if all(r["reason"] for r in results.values()):
            return results
    raise AssertionError("requests did not finish")


def _poison_first_slot_of_every_layer(core) -> None:
    for k_cache, v_cache in core.kv_cache:
        k_cache[0] = float("nan")
        v_cache[0] = float("nan")


def test_nan_in_one_request_fails_only_that_request(tiny_llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)
    alone = make_llm(tiny_llama_dir).generate([SHORT], params, use_chat_template=False)[0].token_ids

    core = make_llm(tiny_llama_dir, max_batch_size=4).engine
    long_req = core.make_request(LONG, params, "long")
    short_req = core.make_request(SHORT, params, "short")
    core.add_request(long_req)
    core.add_request(short_req)
    first = core.step()  # both prefills in one step: each samples its first token
    assert {o.request_id for o in first} == {"long", "short"}
    assert long_req.block_ids[0] == 0 and 0 not in short_req.block_ids
    # The long request's first KV slot goes NaN (a numerical fault inside that request alone).
    _poison_first_slot_of_every_layer(core)

    results = _run_to_end(core, ["long", "short"])
    results["short"]["tokens"][:0] = first[[o.request_id for o in first].index("short")].new_token_ids
    assert results["long"]["reason"] == "error"
    assert "non-finite" in results["long"]["error"]
    assert results["short"]["reason"] == "length" and results["short"]["error"] is None
    assert results["short"]["tokens"] == alone
    assert core.stats.request_success["error"] == 1
    assert core.stats.nonfinite_logits_requests == 1
    assert core.kv_manager.num_free_blocks == core.num_blocks


def test_padding_reads_a_reserved_zero_slot(tiny_llama_dir):
    """Padded context positions point past every allocatable slot, at storage nobody writes."""
    core = make_llm(tiny_llama_dir).engine
    num_slots = core.num_blocks * core.config.block_size
    k_cache = core.kv_cache[0][0]
    assert k_cache.shape[0] == num_slots + 1
    assert torch.count_nonzero(k_cache[num_slots]) == 0


def test_a_draft_model_times_itself_at_start_up_and_a_failing_profile_only_loses_its_price(
    tiny_llama_dir, tiny_draft_dir, monkeypatch, caplog
):
    from specserve.plugins.draft_model import DraftModelProposer

    llm = make_llm(tiny_llama_dir, speculative_method="draft_model", draft_model_path=str(tiny_draft_dir))
    profile = llm.engine.controller.cost.draft_profile
    assert profile is not None and profile.catch_up_token_seconds > 0
    assert [n for n, _ in profile.step_seconds][0] == 1 and all(t > 0 for _, t in profile.step_seconds)

    def broken(self, max_requests):
        raise RuntimeError("no clock here")

    monkeypatch.setattr(DraftModelProposer, "profile_cost", broken)
    with caplog.at_level("WARNING", logger="specserve.engine"):
        llm = make_llm(tiny_llama_dir, speculative_method="draft_model", draft_model_path=str(tiny_draft_dir))
    assert llm.engine.controller.cost.draft_profile is None
    assert "profile_cost failed (no clock here)" in caplog.text
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, speculative_policy="adaptive")
    assert len(llm.generate(["a b c"], params, use_chat_template=False)[0].token_ids) == 6
