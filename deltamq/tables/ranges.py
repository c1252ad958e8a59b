"""Range predicates that Delta file statistics can prune.

A look-up by a list of ids is a full scan (docs/design.md, measured facts); the same look-up by a few
ranges of a column that grows with write order (batch ids, offsets, times) reads only
the files whose min/max overlap.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from pyspark.sql import Column
from pyspark.sql import functions as F

from deltamq import ids

P = TypeVar("P", bound=Any)


def merge_ranges(
    values: list[int], gap: int = 60_000 << ids.BATCH_RANDOM_BITS, most: int = 64
) -> list[tuple[int, int]]:
    """Sorted distinct values → at most ``most`` closed ranges; neighbours closer than
    ``gap`` share a range. A predicate over these ranges lets file statistics prune."""
    points = sorted(set(values))
    if not points:
        return []
    ranges = [[points[0], points[0]]]
    for v in points[1:]:
        if v - ranges[-1][1] <= gap:
            ranges[-1][1] = v
        else:
            ranges.append([v, v])
    while len(ranges) > most:  # merge across the smallest gap
        i = min(range(len(ranges) - 1), key=lambda k: ranges[k + 1][0] - ranges[k][1])
        ranges[i][1] = ranges[i + 1][1]
        del ranges[i + 1]
    return [(lo, hi) for lo, hi in ranges]


def any_of(preds: Iterable[P], none: P | None = None) -> P:
    """OR of ``preds`` (Spark Columns, or pyarrow expressions with ``none`` given) as a
    balanced tree; ``none`` (FALSE) for no predicate. A left-deep chain of a few hundred
    ORs exceeds the nesting depth Spark Connect's protobuf decoder accepts."""
    items = list(preds)
    if not items:
        return F.lit(False) if none is None else none  # type: ignore[return-value]
    while len(items) > 1:
        items = [items[i] | items[i + 1] if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]


def ranges_predicate(column: str, ranges: list[tuple[int, int]]) -> Column:
    """``column`` within any of ``ranges`` (FALSE for none)."""
    return any_of(F.col(column).between(lo, hi) for lo, hi in ranges)


def queue_ranges(ranges: Iterable[tuple[str, int, int, int]]) -> Column:
    """consume_queue rows within any of ``(topic, queue_id, lo, hi)`` (``hi`` exclusive)."""
    return any_of(
        (F.col("topic") == topic) & (F.col("queue_id") == qid) & F.col("queue_offset").between(lo, hi - 1)
        for topic, qid, lo, hi in ranges
    )


def queue_offsets(rows: Iterable[tuple[str, int, int]]) -> Column:
    """consume_queue rows at any of ``(topic, queue_id, queue_offset)``: one ``IN`` list
    per queue, so the expression grows with the queues, not the rows."""
    by_queue: dict[tuple[str, int], set[int]] = {}
    for topic, qid, offset in rows:
        by_queue.setdefault((topic, qid), set()).add(offset)
    return any_of(
        (F.col("topic") == topic) & (F.col("queue_id") == qid) & F.col("queue_offset").isin(sorted(offsets))
        for (topic, qid), offsets in sorted(by_queue.items())
    )
