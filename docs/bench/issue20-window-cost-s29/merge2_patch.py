"""Tried, not kept: decodes and 2-row windows attended as one group (padded to 2 rows) instead of two
(loaded by window_cost.py with MERGE2=1)."""

import specserve.engine.attention as attention

_query_groups = attention.query_groups


def query_groups(query_lens: list[int]) -> list[list[int]]:
    small = [i for i, q in enumerate(query_lens) if q <= 2]
    if any(query_lens[i] == 1 for i in small) and any(query_lens[i] == 2 for i in small):
        rest = [i for i, q in enumerate(query_lens) if q > 2]
        groups = [small]
        if rest:
            groups += [[rest[j] for j in g] for g in _query_groups([query_lens[i] for i in rest])]
        return groups
    return _query_groups(query_lens)


attention.query_groups = query_groups
