"""What a pull hands out, read from the tables (docs/behaviour.md §6): the index rows of
the reserved ranges that the group takes, with their bodies.

Two ways, one result. From the tables' files (deltamq/tables/files.py): a kept
snapshot of ``consume_queue`` and ``commit_log`` picks the few files the ranges and
their batches are in, read with pyarrow, and the group's tag subscriptions are matched
in Python, with no engine round trip. Through the engine: two statements (the index
range with the subscriptions' filter and de-duplication, then the bodies joined by
batch position). The files are read whenever they can be: the engine takes groups
with an SQL92 subscription or a de-duplication key, and tables whose protocol the file
reader does not meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql import functions as F

from deltamq import dedup
from deltamq import file_reads as files
from deltamq.config import GroupConfig, Subscription
from deltamq.filters import subscriptions_filter
from deltamq.tables.bodies import read_bodies
from deltamq.tables.ranges import queue_ranges

if TYPE_CHECKING:
    from deltamq.context import Context

Range = tuple[str, int, int, int]  # topic, queue, first offset, end offset (exclusive)

INDEX_COLUMNS = files.HANDOUT_INDEX_COLUMNS
BODY_COLUMNS = files.HANDOUT_BODY_COLUMNS


def handout_rows(
    ctx: Context,
    group: str,
    cfg: GroupConfig,
    subs: Sequence[Subscription],
    ranges: Sequence[Range],
    now: int,
) -> list[dict[str, Any]]:
    """The rows of ``ranges`` the group takes (matching its subscriptions, not a duplicate
    by key) whose body is still there, in (topic, queue, offset) order: the index columns
    and the body columns of each."""
    rows = None
    if not cfg.dedup_key and all(s.expr_type != "SQL92" for s in subs):
        rows = _from_files(ctx, subs, ranges)
    if rows is None:
        rows = _through_engine(ctx, group, cfg, subs, ranges, now)
    return sorted(rows, key=lambda r: (r["topic"], r["queue_id"], r["queue_offset"]))


def _from_files(ctx: Context, subs: Sequence[Subscription], ranges: Sequence[Range]) -> list[dict] | None:
    return files.handout_rows(ctx.warehouse, subs, ranges, INDEX_COLUMNS, BODY_COLUMNS)


def _through_engine(
    ctx: Context,
    group: str,
    cfg: GroupConfig,
    subs: Sequence[Subscription],
    ranges: Sequence[Range],
    now: int,
) -> list[dict[str, Any]]:
    wh = ctx.warehouse
    cq = wh.read("consume_queue").where(queue_ranges(ranges))
    cq = cq.withColumn("matched", subscriptions_filter(subs, default=True)).where(F.col("matched"))
    # idempotent consumption: a key the group consumed within its window is skipped
    # (treated as acknowledged: never in flight, the acked offset passes it)
    cq = dedup.mark(wh, cq.withColumn("consumer_group", F.lit(group)), {group: cfg}, now).where(~F.col("dup"))
    index = cq.select(*INDEX_COLUMNS).toArrow().to_pylist()
    if not index:
        return []
    keys = pa.table(
        {
            "k_batch": pa.array([r["cl_batch_id"] for r in index], pa.int64()),
            "k_pos": pa.array([r["cl_batch_pos"] for r in index], pa.int64()),
            "k_id": pa.array([r["msg_id"] for r in index], pa.string()),
        }
    )
    places = keys.column("k_pos").to_pylist()
    bodies = (
        read_bodies(wh, (r["cl_date"] for r in index), (r["cl_batch_id"] for r in index))
        .where(F.col("batch_pos").between(min(places), max(places)))
        .join(
            ctx.engine.spark.createDataFrame(keys),
            (F.col("batch_id") == F.col("k_batch"))
            & (F.col("batch_pos") == F.col("k_pos"))
            & (F.col("msg_id") == F.col("k_id")),
        )
        .select("batch_id", "batch_pos", "msg_id", *BODY_COLUMNS)
        .toArrow()
        .to_pylist()
    )
    found = {(b["batch_id"], b["batch_pos"], b["msg_id"]): b for b in bodies}
    out = []
    for r in index:
        b = found.get((r["cl_batch_id"], r["cl_batch_pos"], r["msg_id"]))
        if b is not None:  # its body is gone (retention): skipped, as the engine jobs' join
            r.update((c, b[c]) for c in BODY_COLUMNS)
            out.append(r)
    return out
