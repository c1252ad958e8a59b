"""Reading message bodies and stored ids from ``commit_log`` by ranges.

Jobs that re-store messages (promote, send-back) or hand them to listeners (deliver)
need the ``commit_log`` rows behind ``consume_queue`` entries. They read them by store
date and merged batch-id ranges (so file statistics prune the read to what is needed)
and join on (batch id, batch position, msg id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import date
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from deltamq import ids
from deltamq.schemas import TABLES
from deltamq.tables.ranges import merge_ranges, ranges_predicate

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse


def read_bodies(wh: Warehouse, dates: Iterable[date], batch_ids: Iterable[int]) -> DataFrame:
    """commit_log rows stored on ``dates`` whose batch id is near one of ``batch_ids``."""
    return wh.read("commit_log").where(
        F.col("store_date").isin(sorted(set(dates)))
        & ranges_predicate("batch_id", merge_ranges(list(batch_ids)))
    )


def restore_columns() -> list[Column]:
    """The commit_log columns a job copies when it re-stores a message (promote, send-back):
    ``orig_props`` and ``orig_reconsume`` are the ones it rewrites."""
    return [
        F.col("tags"),
        F.col("keys"),
        F.col("body"),
        F.col("flag"),
        F.col("properties").alias("orig_props"),
        F.col("born_ts"),
        F.col("reconsume_times").alias("orig_reconsume"),
        F.col("sys_flag"),
        F.col("producer_group"),
    ]


def restored_message(
    joined: DataFrame,
    *,
    msg_id: Column,
    topic: Column,
    queue_id: Column,
    properties: Column,
    store_ts: Column,
    reconsume_times: Column,
    batch_id: Column,
    batch_pos: Column,
    sys_flag: Column | None = None,
) -> DataFrame:
    """commit_log rows of re-stored messages: the :func:`restore_columns` copied as they
    are (``sys_flag`` unless given), the rest given by the job (store date derived from
    the store time)."""
    out = joined.select(
        msg_id.alias("msg_id"),
        topic.alias("topic"),
        queue_id.cast("int").alias("queue_id"),
        "tags",
        "keys",
        "body",
        "flag",
        properties.alias("properties"),
        "born_ts",
        store_ts.alias("store_ts"),
        reconsume_times.cast("int").alias("reconsume_times"),
        (F.col("sys_flag") if sys_flag is None else sys_flag.cast("int")).alias("sys_flag"),
        "producer_group",
        batch_id.alias("batch_id"),
        batch_pos.alias("batch_pos"),
        ids.store_date_col(store_ts).alias("store_date"),
    )
    return out.select(*TABLES["commit_log"].columns)


def join_bodies(
    rows: DataFrame, bodies: DataFrame, columns: Sequence[str | Column], msg_id: str = "msg_id"
) -> DataFrame:
    """``rows`` (with ``cl_batch_id``, ``cl_batch_pos`` and ``msg_id``) joined to their
    commit_log row; ``columns`` are taken from the commit_log side."""
    b = bodies.select(
        F.col("batch_id").alias("_b_batch"),
        F.col("batch_pos").alias("_b_pos"),
        F.col("msg_id").alias("_b_id"),
        *columns,
    )
    on = (
        (F.col("cl_batch_id") == F.col("_b_batch"))
        & (F.col("cl_batch_pos") == F.col("_b_pos"))
        & (F.col(msg_id) == F.col("_b_id"))
    )
    return rows.join(b, on).drop("_b_batch", "_b_pos", "_b_id")


def stored_ids(
    wh: Warehouse, store_ms_ranges: Sequence[tuple[int, int]], more_days: Iterable[date] = ()
) -> DataFrame:
    """msg ids of commit_log rows whose batch id encodes a time in the ranges (the ids
    engine jobs derive: look-ups for "already written" before a re-run appends), stored on
    the days of those times or on ``more_days`` (a copy stored at another time than its id
    says: promote's clock-corrected copies)."""
    days = sorted(store_days(store_ms_ranges) | set(more_days))
    return (
        wh.read("commit_log")
        .where(F.col("store_date").isin(days) & ranges_predicate("batch_id", batch_spans(store_ms_ranges)))
        .select("msg_id")
    )


def batch_spans(store_ms_ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The batch ids (closed ranges) that encode a time in the ranges."""
    shift = ids.BATCH_RANDOM_BITS
    return [(lo << shift, ((hi + 1) << shift) - 1) for lo, hi in store_ms_ranges]


def store_days(store_ms_ranges: Sequence[tuple[int, int]]) -> set[date]:
    """The ``store_date`` partitions of the times in the ranges."""
    return {ids.store_date(ms) for lo, hi in store_ms_ranges for ms in range(lo, hi + 1, ids.DAY_MS)} | {
        ids.store_date(hi) for _, hi in store_ms_ranges
    }
