"""The engine ab.py and calib.py run: SmolLM2 bf16 at batch 1 with n-gram speculation (bench_spec_policy's
settings), and the controller at df396e7 (old_ctrl.py, see README.md) built beside the engine's own."""

import copy
from typing import Any

from specserve.engine import LLM


def build_llm() -> LLM:
    return LLM(
        None,
        quantization_encoding="bfloat16",
        num_speculative_tokens=8,
        speculative_policy="adaptive",
        max_length=2048,
        max_kv_cache_tokens=4096,
        max_batch_size=1,
        speculative_method="ngram",
    )


def old_controller(engine: Any) -> Any:
    """The committed controller with a copy of the engine controller's cost model (its start-up profile)."""
    import old_ctrl

    return old_ctrl.SpeculationController(engine.controller.k_max, copy.deepcopy(engine.controller.cost))
