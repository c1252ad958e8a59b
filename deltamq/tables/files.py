"""Index ranges and message bodies read from the tables' files, without the engine.

A pull client reads a few thousand ``consume_queue`` rows and their ``commit_log``
bodies per call. Through the engine that is two statements (tens of milliseconds
each on Sail, more on Spark); here it is the files those rows are in, picked from a
kept snapshot of each table (deltamq/delta_read.py) by partition values and the
offset or batch-id statistics, and read with pyarrow. Each function returns None when
a table must be read with the engine instead (its protocol asks for more than plain
Parquet files).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from deltamq.delta_read import DataFile
from deltamq.tables.ranges import any_of, merge_ranges

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

Range = tuple[str, int, int, int]  # topic, queue, first offset, end offset (exclusive)


def rows(
    wh: Warehouse,
    table: str,
    columns: Sequence[str],
    where: pc.Expression | None = None,
    keep: Callable[[DataFile], bool] | None = None,
) -> pa.Table | None:
    """Rows of a table matching ``where``, ``columns`` only, read from its files (those
    ``keep`` accepts, by partition values and statistics; all by default)."""
    snap = wh.snapshot(table)
    if snap is None:
        return None
    return snap.read(snap.files(keep) if keep else snap.files(), list(columns), where)


def index_rows(wh: Warehouse, ranges: Sequence[Range], columns: Sequence[str]) -> pa.Table | None:
    """``consume_queue`` rows within ``ranges``, ``columns`` only, in no set order."""
    snap = wh.snapshot("consume_queue")
    if snap is None:
        return None
    spans: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for topic, qid, lo, hi in ranges:
        spans[topic].append((qid, lo, hi - 1))

    def keep(f: DataFile) -> bool:
        return any(
            f.overlaps("queue_id", q, q) and f.overlaps("queue_offset", lo, hi)
            for q, lo, hi in spans.get(f.partition.get("topic") or "", ())
        )

    where = _any(
        (pc.field("topic") == topic) & (pc.field("queue_id") == qid) & _between("queue_offset", lo, hi - 1)
        for topic, qid, lo, hi in ranges
    )
    return snap.read(snap.files(keep), list(columns), where)


def bodies(wh: Warehouse, index: pa.Table, columns: Sequence[str]) -> pa.Table | None:
    """``index`` (consume_queue rows: ``cl_date``, ``cl_batch_id``, ``cl_batch_pos``,
    ``msg_id``) with the ``columns`` of each row's ``commit_log`` row; rows whose body is
    gone (retention) are left out, as by the engine jobs' join."""
    snap = wh.snapshot("commit_log")
    if snap is None:
        return None
    if index.num_rows == 0:
        return _with(index, snap.read([], list(columns)))
    batch_ids = index.column("cl_batch_id").to_pylist()
    places = index.column("cl_batch_pos").to_pylist()
    dates = {d.isoformat() for d in index.column("cl_date").unique().to_pylist()}
    batches = merge_ranges(batch_ids)

    def keep(f: DataFile) -> bool:
        if f.partition.get("store_date") not in dates:
            return False
        return any(f.overlaps("batch_id", lo, hi) for lo, hi in batches)

    where = _any(_between("batch_id", lo, hi) for lo, hi in batches) & _between(
        "batch_pos", min(places), max(places)
    )
    found = snap.read(snap.files(keep), ["batch_id", "batch_pos", "msg_id", *columns], where)
    at = {
        key: j
        for j, key in enumerate(
            zip(
                found.column("batch_id").to_pylist(),
                found.column("batch_pos").to_pylist(),
                found.column("msg_id").to_pylist(),
                strict=True,
            )
        )
    }
    pairs = [
        (i, j)
        for i, key in enumerate(zip(batch_ids, places, index.column("msg_id").to_pylist(), strict=True))
        if (j := at.get(key)) is not None
    ]
    return _with(index.take([i for i, _ in pairs]), found.take([j for _, j in pairs]).select(list(columns)))


def _with(rows: pa.Table, more: pa.Table) -> pa.Table:
    for name in more.column_names:
        rows = rows.append_column(more.schema.field(name), more.column(name))
    return rows


def _between(column: str, lo: int, hi: int) -> pc.Expression:
    return (pc.field(column) >= lo) & (pc.field(column) <= hi)


def _any(preds: Iterable[pc.Expression]) -> pc.Expression:
    return any_of(preds, pc.scalar(False))
