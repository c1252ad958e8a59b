"""The pull clients' tables: the deliveries log (``deliveries``) and the access locks
(``queue_lock``), their reads and writes (docs/behaviour.md §6; the protocol is
``deltamq/pull.py``'s). Each function takes the warehouse; a write is one statement
and the caller commits it (``Context.commit``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from deltamq import file_reads as files
from deltamq.constants import ENDED, INFLIGHT, NACK_REQUESTED, REVOKED, TAKEN
from deltamq.pull_log import (
    ENDS_ONLY,
    LOCK_COLUMNS,
    LockEntry,
    LogRow,
    Queue,
    QueueLog,
    as_dict,
    decide_lock,
    ended,
    lock_entries,
    log_table,
    position,
    positions_of,
    sum_up,
    summarise,
)
from deltamq.schemas import SCHEMA_VERSION, TABLES
from deltamq.tables.ranges import any_of, queue_offsets
from deltamq.tables.sqltext import sql_int, sql_long, sql_queues, sql_str

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse


# states of the deliveries log (docs/behaviour.md §6), defined in deltamq/constants.py
__all__ = [  # the log's plain-Python side lives in deltamq/pull_log.py; named here too
    "LockEntry",
    "QueueLog",
    "as_dict",
    "decide_lock",
    "ended",
    "position",
]

_LOG_SCHEMA = TABLES["deliveries"].columns_at(SCHEMA_VERSION)


# --- the access locks -------------------------------------------------------------------------
def read_locks(wh: Warehouse, group: str) -> dict[Queue, LockEntry | None]:
    """Lock rows of the group; a queue whose row has no owner maps to None."""
    found = files.rows(wh, "queue_lock", LOCK_COLUMNS, pc.field("consumer_group") == group)
    rows = (
        found.to_pylist()
        if found is not None
        else wh.read("queue_lock").where(F.col("consumer_group") == group).select(*LOCK_COLUMNS).collect()
    )
    return lock_entries(rows)


def pulled_groups(wh: Warehouse) -> set[str]:
    """The groups pull clients have pulled from: those with a client row, or with lock
    rows (which stay when every client has left and retention removed their rows)."""
    rows = wh.engine.rows(
        f"SELECT consumer_group AS g FROM {wh.ref('clients')} "
        f"UNION SELECT consumer_group AS g FROM {wh.ref('queue_lock')}"
    )
    return {r["g"] for r in rows}


def _lock_scope(group: str, queues: Iterable[Queue]) -> str:
    """The target rows a lock ``MERGE`` may touch, as literals on the partition columns:
    Apache Spark's Delta checks a commit for conflicts against the partitions its
    statement read, and reads every partition unless the condition names them (measured,
    four threads each compare-and-setting its own queue 6 times: 51 conflicts on one
    file, 55 partitioned without these literals, 0 with them; docs/engines.md)."""
    each = " OR ".join(f"(t.topic = {sql_str(t)} AND t.queue_id = {q})" for t, q in sorted(set(queues)))
    return f"t.consumer_group = {sql_str(group)} AND ({each})"


def ensure_lock_rows(wh: Warehouse, group: str, queues: Iterable[Queue]) -> None:
    """Ownerless lock rows for ``queues`` that have none. Taking a lock is then always an
    update of an existing row: concurrent takers conflict (a non-append commit) or fail
    the compare-and-set, never both insert. Two racing inserts here leave identical
    ownerless rows, which every later update changes together. The caller commits."""
    queues = sorted(set(queues))
    values = ", ".join(f"({sql_str(group)}, {sql_str(t)}, {q})" for t, q in queues)
    if not values:
        return
    statement = (
        f"MERGE INTO {wh.ref('queue_lock')} t USING (SELECT * FROM VALUES {values} "
        "AS v(consumer_group, topic, queue_id)) s "
        "ON t.consumer_group = s.consumer_group AND t.topic = s.topic AND t.queue_id = s.queue_id "
        f"AND {_lock_scope(group, queues)} "
        "WHEN NOT MATCHED THEN INSERT (consumer_group, topic, queue_id, owner, last_access_ts, "
        "last_delivered_offset, no_change_count, delivered_offset) VALUES (s.consumer_group, s.topic, "
        "s.queue_id, CAST(NULL AS STRING), CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), 0, "
        "CAST(NULL AS BIGINT))"
    )
    wh.engine.execute(statement)


def write_locks(wh: Warehouse, group: str, changes: list[tuple[Queue, LockEntry | None, LockEntry]]) -> None:
    """Compare-and-set: each (existing, see :func:`ensure_lock_rows`) row changes only if it
    still is what was read."""
    changes = [c for c in changes if c[1] != c[2]]
    if not changes:
        return
    values = ", ".join(
        f"({sql_str(group)}, {sql_str(t)}, {q}, {sql_str(old.owner if old else None)}, "
        f"{sql_long(old.last_access_ts if old else None)}, {sql_str(new.owner)}, "
        f"{sql_long(new.last_access_ts)}, "
        f"{sql_long(new.last_delivered_offset)}, {sql_int(new.no_change_count)}, "
        f"{sql_long(new.delivered_offset)})"
        for (t, q), old, new in changes
    )
    wh.engine.execute(
        f"MERGE INTO {wh.ref('queue_lock')} t USING (SELECT * FROM VALUES {values} AS v("
        "consumer_group, topic, queue_id, exp_owner, exp_access, owner, last_access_ts, "
        "last_delivered_offset, no_change_count, delivered_offset)) s "
        "ON t.consumer_group = s.consumer_group AND t.topic = s.topic AND t.queue_id = s.queue_id "
        f"AND {_lock_scope(group, [q for q, _, _ in changes])} "
        "WHEN MATCHED AND t.owner <=> s.exp_owner AND t.last_access_ts <=> s.exp_access THEN UPDATE SET "
        "t.owner = s.owner, t.last_access_ts = s.last_access_ts, "
        "t.last_delivered_offset = s.last_delivered_offset, t.no_change_count = s.no_change_count, "
        "t.delivered_offset = s.delivered_offset"
    )


def read_positions(
    wh: Warehouse, groups: Iterable[str]
) -> dict[tuple[str, str, int], tuple[int, int | None]]:
    """The stored positions, per (group, topic, queue): (acknowledged offset, delivered
    offset or None)."""
    names = sorted(set(groups))
    if not names:
        return {}
    rows = (
        wh.read("offsets")
        .where(F.col("consumer_group").isin(names) & (F.col("client_id") == ""))
        .select("consumer_group", "topic", "queue_id", "next_offset", "delivered_offset")
        .collect()
    )
    return {
        (r["consumer_group"], r["topic"], r["queue_id"]): (r["next_offset"] or 0, r["delivered_offset"])
        for r in rows
    }


# --- the deliveries log ---------------------------------------------------------------------
def in_flight(wh: Warehouse, group: str) -> int:
    """How many messages ``group``'s pull clients hold (pulled, not acked or expired)."""
    return open_deliveries(wh, F.col("consumer_group") == F.lit(group)).count()


def at_offsets(rows: Iterable[dict[str, Any]]) -> Column:
    """consume_queue rows at the (topic, queue, offset) of ``rows`` (deliveries)."""
    return queue_offsets((r["topic"], r["queue_id"], r["queue_offset"]) for r in rows)


def append(wh: Warehouse, rows: list[LogRow]) -> None:
    """Append rows (in the table's column order) to the deliveries log: a blind append,
    which never conflicts with another client's. The caller commits."""
    wh.append_arrow("deliveries", log_table(rows))


def queues_column(queues: Iterable[Queue]) -> Column:
    return any_of((F.col("topic") == t) & (F.col("queue_id") == q) for t, q in sorted(queues))


def handles_column(handles: Iterable[str]) -> Column:
    """Log rows whose handle is within the ranges the handles form (one per pull: a
    pull's handles share a prefix), a predicate file statistics can prune by."""
    by_prefix: dict[str, list[str]] = defaultdict(list)
    for h in sorted(handles):
        by_prefix[h[:-6]].append(h)
    if len(by_prefix) > 64:
        hs = sorted(handles)
        return F.col("receipt_handle").between(hs[0], hs[-1])
    return any_of(F.col("receipt_handle").between(v[0], v[-1]) for v in by_prefix.values())


def open_deliveries(wh: Warehouse, cond: Column, sent_only: Column | None = None) -> DataFrame:
    log = wh.read("deliveries").where(cond)
    sent = log.where(F.col("state") == INFLIGHT)
    if sent_only is not None:
        sent = sent.where(sent_only)
    over = log.where(F.col("state").isin(*ENDED)).select(F.col("receipt_handle").alias("_ended"))
    return sent.join(over, F.col("receipt_handle") == F.col("_ended"), "left_anti")


def nack_requests(wh: Warehouse) -> dict[str, int]:
    """Nacks requested by clients without an engine: {receipt handle: delay level}."""
    rows = (
        wh.read("deliveries")
        .where(F.col("state") == NACK_REQUESTED)
        .select("receipt_handle", "invisible_until")
        .collect()
    )
    return {r["receipt_handle"]: int(r["invisible_until"] or 0) for r in rows}


def open_rows(wh: Warehouse, cond: Column, sent_only: Column | None = None) -> list[LogRow]:
    """INFLIGHT rows matching ``cond`` (and ``sent_only``) that no row has ended yet."""
    return [
        tuple(r) for r in open_deliveries(wh, cond, sent_only).select(*_LOG_SCHEMA.fieldNames()).collect()
    ]


def summary(
    wh: Warehouse, group: str | None = None, queues: Iterable[Queue] | None = None
) -> dict[tuple[str, str, int], QueueLog]:
    """{(group, topic, queue): QueueLog} of the log: from its files (a log of at most
    ``file_reads.MAX_LOG_ROWS`` rows, read through the kept snapshot: an empty log costs
    a look at its next commit entry), else in one statement."""
    wanted = None if queues is None else list(queues)
    where = None if group is None else pc.field("consumer_group") == group
    if wanted is not None:
        where = files.queues_filter(wanted) if where is None else where & files.queues_filter(wanted)
    found = files.log_table(wh, where, most=files.MAX_LOG_ROWS)
    if found is not None:
        return summarise(found)
    return _summary_by_engine(wh, group, wanted)


def _summary_by_engine(
    wh: Warehouse, group: str | None, queues: Iterable[Queue] | None
) -> dict[tuple[str, str, int], QueueLog]:
    where = []
    if group is not None:
        where.append(f"consumer_group = {sql_str(group)}")
    if queues is not None:
        where.append(sql_queues(queues))
    ended_states = ", ".join(sql_str(s) for s in ENDED)
    ends_only = ", ".join(sql_str(s) for s in ENDS_ONLY)
    statement = (
        "SELECT consumer_group, topic, queue_id, ts, cls, min(off) AS lo, max(off) AS hi, "
        "min(due) AS due FROM (SELECT consumer_group, topic, queue_id, "
        "receipt_handle, min(delivered_ts) AS ts, min(queue_offset) AS off, "
        f"min(CASE WHEN state = {sql_str(INFLIGHT)} THEN invisible_until "
        f"WHEN state = {sql_str(NACK_REQUESTED)} THEN delivered_ts END) AS due, "
        f"CASE WHEN max(CASE WHEN state = {sql_str(TAKEN)} THEN 1 ELSE 0 END) = 1 THEN 'T' "
        f"WHEN max(CASE WHEN state = {sql_str(REVOKED)} THEN 1 ELSE 0 END) = 1 THEN 'R' "
        f"WHEN min(CASE WHEN state IN ({ends_only}) THEN 1 ELSE 0 END) = 1 THEN 'O' "
        f"WHEN max(CASE WHEN state IN ({ended_states}) THEN 1 ELSE 0 END) = 1 THEN 'D' "
        f"WHEN max(CASE WHEN state = {sql_str(NACK_REQUESTED)} THEN 1 ELSE 0 END) = 1 THEN 'N' "
        f"WHEN max(CASE WHEN state = {sql_str(INFLIGHT)} THEN 1 ELSE 0 END) = 1 THEN 'I' "
        f"ELSE 'D' END AS cls FROM {wh.ref('deliveries')}"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + " GROUP BY consumer_group, topic, queue_id, receipt_handle) h "
        "GROUP BY consumer_group, topic, queue_id, ts, cls"
    )
    return sum_up(wh.engine.rows(statement))


def positions(
    wh: Warehouse, group: str, queues: Iterable[Queue] | None = None
) -> dict[Queue, tuple[int, int]]:
    """Per queue of ``group`` (only ``queues`` if given): (acknowledged offset, delivered
    offset) now — the log read first, then the stored offsets (the fold writes offsets
    before it deletes log rows, so this order never misses a position)."""
    wanted = None if queues is None else sorted(set(queues))
    logs = summary(wh, group, wanted)
    return positions_of(group, logs, read_positions(wh, [group]), wanted)
