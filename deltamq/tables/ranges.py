"""Range predicates that Delta file statistics can prune.

A look-up by a list of ids is a full scan (docs/design.md, measured facts); the same look-up by a few
ranges of a column that grows with write order (batch ids, offsets, times) reads only
the files whose min/max overlap.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyspark.sql import Column
from pyspark.sql import functions as F

from deltamq.file_reads import balanced_or, merge_ranges

__all__ = ["any_of", "merge_ranges", "queue_offsets", "queue_ranges", "ranges_predicate"]


def any_of(preds: Iterable[Column]) -> Column:
    """OR of ``preds`` as a balanced tree (FALSE for none): deltamq/file_reads.py's."""
    return balanced_or(preds, F.lit(False))


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
