"""Tried, not kept: a step's verification windows attended as single-row queries, one per window row
over its own prefix, so decodes and windows form one group (loaded by window_cost.py with EXPAND=1)."""

import specserve.engine.attention as attention

_build = attention.AttentionMetadata.build.__func__


def build(
    cls, query_lens, context_lens, block_tables, block_size, device="cpu", pad_slot=0, context_starts=None
):
    if 1 in query_lens and max(query_lens) > 1 and max(query_lens) <= attention.SMALL_QUERY_ROWS:
        rows, contexts, tables, starts = [], [], [], []
        for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
            for j in range(q):  # row j of the window sees its prefix: c - q + 1 + j positions
                rows.append(1)
                contexts.append(c - q + 1 + j)
                tables.append(table)
                if context_starts is not None:
                    starts.append(context_starts[i])
        return _build(cls, rows, contexts, tables, block_size, device, pad_slot, starts or None)
    return _build(cls, query_lens, context_lens, block_tables, block_size, device, pad_slot, context_starts)


attention.AttentionMetadata.build = classmethod(build)
