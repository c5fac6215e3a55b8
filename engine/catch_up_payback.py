"""How many tokens a request emits in drafting steps after its proposer caught up, per batch bucket.

A draft model that has not seen a request's last tokens feeds them first (a catch-up: the whole
prompt the first time). The controller charges that once-only cost to the drafting steps it pays
for, a share per step by the tokens the step is expected to emit. Whether those steps come is
another matter: at one client a request that starts drafting drafts to its end, but at 8 Qwen-pair
clients on the AMD EPYC (served, twenty-first session) drafting stopped a few steps after the
catch-ups, 1,305 catch-up tokens (~3.5 s of draft time) were never earned back, and speculation ran
at 0.92x of off where it assumed the requests would draft until they finished.

So every catch-up opens a record of its request: the tokens it then emits in steps where it drafts,
until it finishes or catches up again (drafting stopped long enough to fall behind: the earlier
catch-up's payback is over). Closed records make a decayed mean per batch bucket, the payback
horizon: a catch-up at that bucket is spread over at most that many tokens. A bucket without a
closed record assumes the request drafts to its end (the charge before this record existed).

Tokens, not a share of the tokens left: a request's `max_tokens` often far exceeds what it emits
before its end-of-sequence, and a catch-up is paid back by tokens emitted, not by tokens allowed.
Pure Python, keyed by whatever bucket the caller uses.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the earlier records against a newly closed one (memory ~5 records per bucket).
PAYBACK_DECAY = 0.8


@dataclass
class _OpenRecord:
    bucket: int
    drafted_tokens: int = 0


@dataclass
class _Horizon:
    tokens: float = 0.0
    weight: float = 0.0

    def observe(self, tokens: int) -> None:
        self.tokens = PAYBACK_DECAY * self.tokens + tokens
        self.weight = PAYBACK_DECAY * self.weight + 1.0

    @property
    def mean(self) -> float:
        return self.tokens / self.weight


class CatchUpPayback:
    def __init__(self) -> None:
        self._open: dict[str, _OpenRecord] = {}  # request id -> its last catch-up's record
        self._horizons: dict[int, _Horizon] = {}  # batch bucket -> closed records

    def horizon(self, bucket: int) -> float | None:
        """Mean tokens emitted in drafting steps after a catch-up at this bucket (None: no record)."""
        closed = self._horizons.get(bucket)
        return closed.mean if closed is not None else None

    def caught_up(self, request_id: str, bucket: int) -> None:
        """The request's proposer catches up this step, in a batch of this bucket (it drafts too)."""
        self._close(request_id)
        self._open[request_id] = _OpenRecord(bucket)

    def drafted(self, request_id: str, emitted_tokens: int) -> None:
        """A step where the request had drafts emitted this many of its tokens."""
        record = self._open.get(request_id)
        if record is not None:
            record.drafted_tokens += max(0, emitted_tokens)

    def finished(self, request_id: str) -> None:
        self._close(request_id)

    def _close(self, request_id: str) -> None:
        record = self._open.pop(request_id, None)
        if record is not None:
            self._horizons.setdefault(record.bucket, _Horizon()).observe(record.drafted_tokens)
