"""Retention (docs/behaviour.md §8): expired messages leave ``consume_queue`` and ``commit_log``.

Runs at most every ``retain_interval_ms`` (hourly) in the tick, under its own lease.

1. **Index.** Per queue, the index keeps a dense suffix: everything from the first row
   that must stay. A row must stay while it is younger than ``file_reserved_time``
   (72 h) or, whatever its age, when it is a dead letter younger than
   ``dlq_reserved_time`` (7 days), a schedule entry the schedule service has not
   promoted yet, or a half/op entry the transaction check has not walked yet. Held
   timers (``rmq_sys_wheel_timer``, read by due time, not by offset) are removed one by
   one once promoted and expired. Deleting a prefix keeps offsets dense; the queue's
   minimum offset moves up, and every group whose offset is below it skips forward to
   it (those messages expired unconsumed: counted as ``skipped``).
2. **Bodies.** ``commit_log`` partitions (store days) older than the cut-off lose every
   row no remaining index row points at; rows dispatch has not indexed yet are never
   touched. The delete goes through delta-rs (the ``deltalake`` package), whose
   conflict checker lets producers keep appending to today's partition meanwhile —
   Sail fails any non-append commit when another commit landed, so a Sail ``DELETE``
   would starve under continuous sends (docs/engines.md).
3. **Bookkeeping.** ``consumed_keys`` past each group's dedup window, ``job_runs`` past
   ``job_runs_reserved_time`` (7 days), ``dq_results`` past ``dq_reserved_time`` (30 days).
4. **Compaction, checkpoints, vacuum, log cleanup** (``deltamq/jobs/compact.py``) unless
   ``compact`` is off.

The first pass on a new warehouse is due one interval after its first tick.

Crash-safe and idempotent: the index goes first (a body is removed only after nothing
points at it), every step recomputes from the tables, and a re-run finishes the work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from deltamq import dedup, faults, ids
from deltamq.constants import (
    DLQ_PREFIX,
    RETAIN_GROUP,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
)
from deltamq.tables.offsets import advance_offsets, group_positions
from deltamq.tables.sqltext import sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.broker import Broker

JOB = "retain"


@dataclass(frozen=True)
class RetainResult:
    ran: bool
    index_rows: int = 0  # consume_queue rows removed
    timer_rows: int = 0
    queues: int = 0  # queues whose minimum moved
    skipped: int = 0  # messages a group had not consumed when they expired
    groups_moved: int = 0
    body_days: int = 0  # commit_log partitions trimmed
    body_rows: int = 0
    kept_old_batches: int = 0  # old batches kept because a remaining index row needs them
    pruned: dict[str, int] = field(default_factory=dict)  # bookkeeping tables -> rows removed
    compacted: Any = None  # compact.CompactResult
    log_entries: int = 0  # Delta log entries deleted between passes

    @property
    def details(self) -> dict[str, int]:
        out = {
            "ran": int(self.ran),
            "index_rows": self.index_rows,
            "timer_rows": self.timer_rows,
            "queues": self.queues,
            "skipped": self.skipped,
            "groups_moved": self.groups_moved,
            "body_days": self.body_days,
            "body_rows": self.body_rows,
            "kept_old_batches": self.kept_old_batches,
            "log_entries_removed": self.log_entries,
        }
        out |= {f"pruned_{k}": v for k, v in self.pruned.items()}
        return out | (self.compacted.details if self.compacted is not None else {})


def _last_run(broker: Broker, *, fresh: bool = False) -> int | None:
    """The last pass's now, remembered per broker: an idle tick within the interval asks
    nothing; ``fresh`` reads the table (a pass another runner made meanwhile)."""
    if not fresh and broker._retain_last is not None:
        return broker._retain_last
    rows = broker.engine.rows(
        f"SELECT progress_version FROM {broker.warehouse.ref('offsets')} "
        f"WHERE consumer_group = {sql_str(RETAIN_GROUP)} AND queue_id = -1"
    )
    broker._retain_last = rows[0]["progress_version"] if rows else None
    return broker._retain_last


def _count(broker: Broker, query: str) -> int:
    return broker.engine.rows(query)[0]["n"] or 0


def run(broker: Broker, now: int, *, fence=None, force: bool = False) -> RetainResult:
    """One retention pass at ``now`` (skipped within ``retain_interval_ms`` of the last
    one unless ``force``)."""
    cfg = broker.config
    if not force:
        last = _last_run(broker)
        if last is not None and now - last >= cfg.retain_interval_ms:
            last = _last_run(broker, fresh=True)  # due by our memory: did another runner run it?
        if last is None:  # a new warehouse: the first pass is due an interval from now
            _record_run(broker, now)
            return RetainResult(False)
        if now - last < cfg.retain_interval_ms:
            from deltamq.jobs import compact

            # between passes only the Delta logs are trimmed (on the wall clock: they grow
            # with every tick, however far apart the ticks' `now`s are)
            return RetainResult(False, log_entries=compact.cleanup_logs_if_due(broker) if cfg.compact else 0)
    cut = now - cfg.file_reserved_time_ms
    dlq_cut = now - cfg.dlq_reserved_time_ms
    if fence:
        fence()
    index_rows, timer_rows, queues, moves = _trim_index(broker, cut, dlq_cut)
    faults.point("retain.after_index_commit")
    skipped, moved = _skip_consumers(broker, moves, now)
    faults.point("retain.after_offsets_commit")
    days, body_rows, kept = _trim_bodies(broker, cut)
    faults.point("retain.after_bodies_commit")
    pruned = _prune_bookkeeping(broker, now)
    from deltamq.jobs import compact

    compacted = compact.run(broker, now) if cfg.compact else None
    _record_run(broker, now)
    return RetainResult(
        True, index_rows, timer_rows, queues, skipped, moved, days, body_rows, kept, pruned, compacted
    )


def _record_run(broker: Broker, now: int) -> None:
    broker.engine.commit(
        lambda: advance_offsets(broker.warehouse, RETAIN_GROUP, [("", -1, None, now)], now), what="offsets"
    )
    broker._retain_last = now


# --- 1. the index -----------------------------------------------------------------------------
def _stays(cut: int, dlq_cut: int, promote, check) -> str:
    """SQL: a consume_queue row that must stay (whatever the prefix rule adds)."""
    promoted_to = " ".join(f"WHEN {q} THEN {sql_long(o)}" for q, o in sorted(promote.level_offsets.items()))
    level_offset = f"CASE queue_id {promoted_to} ELSE 0 END" if promoted_to else "0"
    return (
        f"(store_ts >= {sql_long(cut)} "
        f"OR (topic LIKE '{DLQ_PREFIX}%' AND store_ts >= {sql_long(dlq_cut)}) "
        f"OR (topic = {sql_str(SCHEDULE_TOPIC)} AND queue_offset >= {level_offset}) "
        f"OR (topic = {sql_str(TRANS_HALF_TOPIC)} AND queue_offset >= {sql_long(check.half_offset)}) "
        f"OR (topic = {sql_str(TRANS_OP_HALF_TOPIC)} AND queue_offset >= {sql_long(check.op_offset)}))"
    )


def _trim_index(broker: Broker, cut: int, dlq_cut: int) -> tuple[int, int, int, dict[tuple[str, int], int]]:
    """Delete each queue's expired prefix and the promoted expired timers; returns (index
    rows, timer rows, queues trimmed, {queue: new minimum})."""
    from deltamq.jobs import check_transactions, promote

    wh = broker.warehouse
    cq = wh.ref("consume_queue")
    p = promote.load_state(wh)
    c = check_transactions.load_state(wh)
    stays = _stays(cut, dlq_cut, p, c)
    heads = broker.engine.rows(
        f"SELECT topic, queue_id, min(queue_offset) AS lo, max(queue_offset) + 1 AS head, "
        f"min(CASE WHEN {stays} THEN queue_offset END) AS keep FROM {cq} "
        f"WHERE topic <> {sql_str(TIMER_TOPIC)} GROUP BY topic, queue_id"
    )
    moves: dict[tuple[str, int], int] = {}
    index_rows = 0
    for r in heads:
        keep = r["head"] if r["keep"] is None else r["keep"]  # nothing must stay: all of it goes
        if keep > r["lo"]:
            moves[(r["topic"], r["queue_id"])] = keep
            index_rows += keep - r["lo"]
    if moves:
        values = ", ".join(f"({sql_str(t)}, {q}, {sql_long(m)})" for (t, q), m in sorted(moves.items()))
        statement = (
            f"MERGE INTO {cq} t USING (SELECT * FROM VALUES {values} AS v(topic, queue_id, keep_from)) s "
            "ON t.topic = s.topic AND t.queue_id = s.queue_id AND t.queue_offset < s.keep_from "
            "WHEN MATCHED THEN DELETE"
        )
        broker.engine.commit(lambda: broker.engine.execute(statement), what="consume_queue")
    timers = (
        f"topic = {sql_str(TIMER_TOPIC)} AND store_ts < {sql_long(cut)} "
        f"AND due_ts <= {sql_long(p.timer_watermark)} AND queue_offset < {sql_long(p.timer_next_offset)}"
    )
    timer_rows = _count(broker, f"SELECT count(*) AS n FROM {cq} WHERE {timers}")
    if timer_rows:
        broker.engine.commit(
            lambda: broker.engine.execute(f"DELETE FROM {cq} WHERE {timers}"), what="consume_queue"
        )
    return index_rows, timer_rows, len(moves), moves


def _skip_consumers(broker: Broker, moves: dict[tuple[str, int], int], now: int) -> tuple[int, int]:
    """Group offsets below a queue's new minimum skip to it — stored ones, and the
    implicit 0 of a subscribed group that has no row for the queue yet; returns (messages
    skipped, offset rows moved)."""
    if not moves:
        return 0, 0
    wh = broker.warehouse
    groups = broker.groups()
    positions = group_positions(wh, moves)
    for sub in broker.subscriptions():
        cfg = groups.get(sub["consumer_group"])
        if cfg is None:
            continue
        clients = list(cfg.get("instances") or []) if cfg["mode"] == "BROADCASTING" else [""]
        for client in clients:
            for topic, qid in moves:
                if topic == sub["topic"]:
                    positions.setdefault((sub["consumer_group"], client, topic, qid), 0)
    behind = {k: v for k, v in positions.items() if (k[2], k[3]) in moves and v < moves[(k[2], k[3])]}
    if not behind:
        return 0, 0
    skipped = sum(moves[(t, q)] - v for (_, _, t, q), v in behind.items())
    values = ", ".join(
        f"({sql_str(g)}, {sql_str(c)}, {sql_str(t)}, {q}, {sql_long(moves[(t, q)])})"
        for (g, c, t, q) in sorted(behind)
    )
    statement = (
        f"MERGE INTO {wh.ref('offsets')} t USING (SELECT * FROM VALUES {values} "
        "AS v(consumer_group, client_id, topic, queue_id, minimum)) s "
        "ON t.consumer_group = s.consumer_group AND t.client_id = s.client_id AND t.topic = s.topic "
        "AND t.queue_id = s.queue_id "
        "WHEN MATCHED THEN UPDATE SET t.next_offset = greatest(coalesce(t.next_offset, 0), s.minimum), "
        "t.delivered_offset = CASE WHEN t.delivered_offset IS NULL THEN NULL "
        "ELSE greatest(t.delivered_offset, s.minimum) END, "
        f"t.updated_ts = {sql_long(now)} "
        "WHEN NOT MATCHED THEN INSERT (consumer_group, topic, queue_id, client_id, next_offset, attempts, "
        "suspend_until, progress_version, attempt_ts, updated_ts) VALUES (s.consumer_group, s.topic, "
        "s.queue_id, s.client_id, s.minimum, CAST(NULL AS INT), CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), "
        f"CAST(NULL AS BIGINT), {sql_long(now)})"
    )
    broker.engine.commit(lambda: broker.engine.execute(statement), what="offsets")
    return skipped, len(behind)


# --- 2. the bodies ----------------------------------------------------------------------------
def _trim_bodies(broker: Broker, cut: int) -> tuple[int, int, int]:
    """Old commit_log days lose the rows no index row points at; returns (days trimmed,
    rows removed, old batches kept for remaining index rows)."""
    from deltamq.jobs import dispatch
    from deltamq.tables import deltalog

    wh = broker.warehouse
    cut_day = ids.store_date(cut)
    # days that still hold rows dispatch has not indexed are left alone
    undispatched = {
        f.partition_values.get("store_date")
        for c in deltalog.commits_after(
            wh.storage, wh.uri("commit_log"), dispatch.load_state(wh).version, 10**9
        )
        for f in c.files
    }
    days = [
        r["store_date"]
        for r in broker.engine.rows(
            f"SELECT DISTINCT store_date FROM {wh.ref('commit_log')} "
            f"WHERE store_date < DATE'{cut_day.isoformat()}'"
        )
        if r["store_date"].isoformat() not in undispatched
    ]
    if not days:
        return 0, 0, 0
    needed: dict[Any, list[int]] = {d: [] for d in days}
    for r in broker.engine.rows(
        f"SELECT DISTINCT cl_date, cl_batch_id FROM {wh.ref('consume_queue')} "
        f"WHERE cl_date < DATE'{cut_day.isoformat()}'"
    ):
        if r["cl_date"] in needed:
            needed[r["cl_date"]].append(r["cl_batch_id"])
    table = wh.delta_rs("commit_log")
    removed = kept = 0
    for day in sorted(days):
        keep = sorted(set(needed[day]))
        predicate = f"store_date = '{day.isoformat()}'"
        if keep:
            predicate += " AND batch_id NOT IN (" + ", ".join(str(int(b)) for b in keep) + ")"
        metrics = table.delete(predicate)
        removed += int((metrics or {}).get("num_deleted_rows") or 0)
        kept += len(keep)
    return len(days), removed, kept


# --- 3. bookkeeping ---------------------------------------------------------------------------
def _prune_bookkeeping(broker: Broker, now: int) -> dict[str, int]:
    wh = broker.warehouse
    cfg = broker.config
    out: dict[str, int] = {}
    conds = {
        "job_runs": f"run_date < DATE'{ids.store_date(now - cfg.job_runs_reserved_time_ms).isoformat()}'",
        "dq_results": f"run_ts < {sql_long(now - cfg.dq_reserved_time_ms)}",
    }
    out["consumed_keys"] = dedup.prune(wh, broker.groups(), now, orphans=True)
    for table, cond in conds.items():
        n = _count(broker, f"SELECT count(*) AS n FROM {wh.ref(table)} WHERE {cond}")
        if n:
            statement = f"DELETE FROM {wh.ref(table)} WHERE {cond}"
            broker.engine.commit(partial(broker.engine.execute, statement), what=table)
        out[table] = n
    return out
