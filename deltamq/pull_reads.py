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
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
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
) -> pa.Table:
    """The rows of ``ranges`` the group takes (matching its subscriptions, not a duplicate
    by key) whose body is still there, in no set order: the index columns and the body
    columns of each."""
    rows = None
    if not cfg.dedup_key and all(s.expr_type != "SQL92" for s in subs):
        rows = files.handout_rows(ctx.warehouse, subs, ranges, INDEX_COLUMNS, BODY_COLUMNS)
    if rows is None:
        rows = _through_engine(ctx, group, cfg, subs, ranges, now)
    return rows


def _through_engine(
    ctx: Context,
    group: str,
    cfg: GroupConfig,
    subs: Sequence[Subscription],
    ranges: Sequence[Range],
    now: int,
) -> pa.Table:
    wh = ctx.warehouse
    cq = wh.read("consume_queue").where(queue_ranges(ranges))
    cq = cq.withColumn("matched", subscriptions_filter(subs, default=True)).where(F.col("matched"))
    # idempotent consumption: a key the group consumed within its window is skipped
    # (treated as acknowledged: never in flight, the acked offset passes it)
    cq = dedup.mark(wh, cq.withColumn("consumer_group", F.lit(group)), {group: cfg}, now).where(~F.col("dup"))
    index = cq.select(*INDEX_COLUMNS).toArrow()
    if index.num_rows == 0:
        return index
    places = index.column("cl_batch_pos")
    lo, hi = pc.min(places).as_py(), pc.max(places).as_py()
    keys = pa.table(
        {
            "k_batch": index.column("cl_batch_id"),
            "k_pos": places,
            "k_id": index.column("msg_id"),
        }
    )
    found = (
        read_bodies(wh, index.column("cl_date").to_pylist(), index.column("cl_batch_id").to_pylist())
        .where(F.col("batch_pos").between(lo, hi))
        .join(
            ctx.engine.spark.createDataFrame(keys),
            (F.col("batch_id") == F.col("k_batch"))
            & (F.col("batch_pos") == F.col("k_pos"))
            & (F.col("msg_id") == F.col("k_id")),
        )
        .select("batch_id", "batch_pos", "msg_id", *BODY_COLUMNS)
        .toArrow()
    )
    # a row whose body is gone (retention) is skipped, as by the engine jobs' join
    return files.join_bodies(index, [found], BODY_COLUMNS)
