"""One 16-sequence SmolLM2 decode step, scheduled with room for 8 drafts a request, and batches of it
with placeholder verification windows: what window_cost.py and after_a_window.py time."""

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams
from specserve.engine.engine_core import EngineCore
from specserve.engine.step_batch import Draft, WindowBatch


def decoding_step() -> tuple[EngineCore, list, list[str]]:
    """(the engine, the step's scheduled requests, their ids): 16 requests past their prompts, every one
    decoding, the next step scheduled with 8 draft slots a request."""
    llm = LLM(None, max_batch_size=16, num_speculative_tokens=8, speculative_policy="static")
    eng = llm.engine
    prompts = [
        llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 3)
    ][:16]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True, speculative_enabled=False)
    for p in prompts:
        eng.add_request(eng.make_request(p, params))
    for _ in range(30):  # prompts prefilled, every request decoding
        eng.step()
    for r in eng.scheduler.running:  # the next step allocates 8 draft slots a request
        r.params.speculative_enabled = True
        r.params.speculative_policy = "static"
        r.params.num_speculative_tokens = 8
    sched = eng.scheduler.schedule()
    assert len(sched.scheduled) == 16 and all(s.num_new_tokens == 1 for s in sched.scheduled)
    return eng, sched.scheduled, [s.request.request_id for s in sched.scheduled]


def with_windows(eng: EngineCore, scheduled: list, drafts: dict[str, int]) -> WindowBatch:
    """The step's batch with `drafts[request id]` placeholder draft tokens for those requests."""
    return WindowBatch.build(scheduled, eng._states, {r: Draft([42] * k, None) for r, k in drafts.items()})
