"""The catch-up payback record (the controller's use of it: tests/engine/test_spec_controller.py)."""

from __future__ import annotations

import pytest

from specserve.engine.catch_up_payback import PAYBACK_DECAY, CatchUpPayback


def test_a_record_counts_the_tokens_of_drafting_steps_until_the_request_finishes_or_catches_up_again():
    payback = CatchUpPayback()
    payback.drafted("a", 5)  # no catch-up yet: nothing to pay back
    assert payback.horizon(1) is None
    payback.caught_up("a", bucket=1)
    payback.drafted("a", 3)
    payback.drafted("a", 4)
    assert payback.horizon(1) is None  # still open
    payback.caught_up("a", bucket=4)  # fell behind and catches up again: the first payback is over
    assert payback.horizon(1) == 7
    payback.drafted("a", 2)
    payback.finished("a")
    payback.finished("a")  # twice is harmless
    assert payback.horizon(4) == 2 and payback.horizon(1) == 7
    payback.caught_up("b", bucket=4)
    payback.finished("b")  # caught up and never drafted again
    assert payback.horizon(4) == pytest.approx((PAYBACK_DECAY * 2 + 0) / (PAYBACK_DECAY + 1))
