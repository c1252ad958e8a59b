"""Range predicates that Delta file statistics can prune.

A look-up by a list of ids is a full scan (STACK.md); the same look-up by a few
ranges of a column that grows with write order (batch ids, offsets, times) reads only
the files whose min/max overlap.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyspark.sql import Column
from pyspark.sql import functions as F

from deltamq import ids


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


def ranges_predicate(column: str, ranges: list[tuple[int, int]]) -> Column:
    """``column`` within any of ``ranges`` (FALSE for none)."""
    pred = F.lit(False)
    for lo, hi in ranges:
        pred = pred | F.col(column).between(lo, hi)
    return pred


def queue_ranges(ranges: Iterable[tuple[str, int, int, int]]) -> Column:
    """consume_queue rows within any of ``(topic, queue_id, lo, hi)`` (``hi`` exclusive)."""
    pred = F.lit(False)
    for topic, qid, lo, hi in ranges:
        pred = pred | (
            (F.col("topic") == topic) & (F.col("queue_id") == qid) & F.col("queue_offset").between(lo, hi - 1)
        )
    return pred
