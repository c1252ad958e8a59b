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

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from deltamq import dedup, faults, ids
from deltamq.constants import (
    RESEND_PRODUCER_GROUP,
    RETAIN_GROUP,
    TIMER_TOPIC,
)
from deltamq.tables import commit_log, consume_queue
from deltamq.tables.consume_queue import load_dispatch_state
from deltamq.tables.offsets import (
    OffsetsMerge,
    QueueKey,
    advance_offsets,
    forward,
    fresh_head,
    group_positions,
    progress,
    source,
)
from deltamq.tables.sqltext import sql_long
from deltamq.tables.warehouse import OUTSIDE_THE_ENGINE

if TYPE_CHECKING:
    from deltamq.context import Context

JOB = "retain"


@dataclass
class Memory:
    """What retain remembers between ticks (owned by the tick runner): its last pass's
    ``now`` and the wall time of the last Delta log cleanup. A fresh one reads the table."""

    last_pass: int | None = None
    log_cleanup_wall: float | None = None


@dataclass(frozen=True, kw_only=True)
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


def _last_run(ctx: Context, memory: Memory, *, fresh: bool = False) -> int | None:
    """The last pass's now, as remembered: an idle tick within the interval asks nothing;
    ``fresh`` reads the table (a pass another runner made meanwhile)."""
    if not fresh and memory.last_pass is not None:
        return memory.last_pass
    rows = [r for r in progress(ctx.warehouse, {RETAIN_GROUP: None})[RETAIN_GROUP] if r.queue_id == -1]
    memory.last_pass = rows[0].progress_version if rows else None
    return memory.last_pass


def _count(ctx: Context, query: str) -> int:
    return ctx.engine.rows(query)[0]["n"] or 0


def run(
    ctx: Context,
    now: int,
    *,
    fence: Callable[[], None] | None = None,
    force: bool = False,
    memory: Memory | None = None,
) -> RetainResult:
    """One retention pass at ``now`` (skipped within ``retain_interval_ms`` of the last
    one unless ``force``). ``memory``: the tick runner's, kept between its ticks."""
    cfg = ctx.config
    memory = Memory() if memory is None else memory
    if not force:
        last = _last_run(ctx, memory)
        if last is not None and now - last >= cfg.retain_interval_ms:
            last = _last_run(ctx, memory, fresh=True)  # due by our memory: did another runner run it?
        if last is None:  # a new warehouse: the first pass is due an interval from now
            _record_run(ctx, memory, now)
            return RetainResult(ran=False)
        if now - last < cfg.retain_interval_ms:
            from deltamq.jobs import compact

            # between passes only the Delta logs are trimmed (on the wall clock: they grow
            # with every tick, however far apart the ticks' `now`s are)
            if not cfg.compact:
                return RetainResult(ran=False)
            return RetainResult(ran=False, log_entries=compact.cleanup_logs_if_due(ctx, memory))
    cut = now - cfg.file_reserved_time_ms
    dlq_cut = now - cfg.dlq_reserved_time_ms
    if fence:
        fence()
    index_rows, timer_rows, queues, minimums = _trim_index(ctx, cut, dlq_cut)
    faults.point("retain.after_index_commit")
    skipped, moved = _skip_consumers(ctx, minimums, now)
    faults.point("retain.after_offsets_commit")
    # a delete whose commit was refused (a concurrent writer, or its own commit landing
    # while its answer was lost: delta-rs then sees "a concurrent transaction deleted
    # data this operation read") is planned again from the table as it now is
    days, body_rows, kept = ctx.commit(partial(_trim_bodies, ctx, cut, dlq_cut), what="commit_log")
    faults.point("retain.after_bodies_commit")
    pruned = _prune_bookkeeping(ctx, now)
    from deltamq.jobs import compact

    compacted = compact.run(ctx, now, memory) if cfg.compact else None
    _record_run(ctx, memory, now, cut)
    return RetainResult(
        ran=True,
        index_rows=index_rows,
        timer_rows=timer_rows,
        queues=queues,
        skipped=skipped,
        groups_moved=moved,
        body_days=days,
        body_rows=body_rows,
        kept_old_batches=kept,
        pruned=pruned,
        compacted=compacted,
    )


def _record_run(ctx: Context, memory: Memory, now: int, cut: int | None = None) -> None:
    """The pass's ``now`` (``progress_version``) and, after a pass that ran, the cut it
    applied (``next_offset``: messages due before it left their queues; the ``messages``
    view calls them ``expired``, deltamq/tables/views.py)."""
    ctx.commit(
        lambda: advance_offsets(ctx.warehouse, RETAIN_GROUP, [("", -1, cut, now)], now), what="offsets"
    )
    memory.last_pass = now


# --- 1. the index -----------------------------------------------------------------------------
def _held(ctx: Context) -> consume_queue.HeldState:
    """Where promote and check-back stand: what retention must not remove."""
    from deltamq.jobs import check_transactions, promote

    p = promote.load_state(ctx.warehouse)
    c = check_transactions.load_state(ctx.warehouse)
    return consume_queue.HeldState(
        level_offsets=p.level_offsets,
        timer_watermark=p.timer_watermark,
        timer_next_offset=p.timer_next_offset,
        half_offset=c.half_offset,
        op_offset=c.op_offset,
    )


def _trim_index(ctx: Context, cut: int, dlq_cut: int) -> tuple[int, int, int, dict[tuple[str, int], int]]:
    """Delete each queue's expired prefix and the promoted expired timers; returns (index
    rows, timer rows, queues trimmed, {queue: minimum offset once trimmed}) — the minimum
    of every queue above 0, not only of those trimmed now: a pass killed after this
    commit left groups behind, and its re-run moves them (a queue emptied altogether has
    its head, dispatch's next offset, as its minimum)."""
    wh = ctx.warehouse
    held = _held(ctx)
    moves: dict[tuple[str, int], int] = {}
    minimums = {q: h for q, h in load_dispatch_state(wh).heads.items() if h > 0 and q[0] != TIMER_TOPIC}
    index_rows = 0
    for e in consume_queue.extents(wh, cut, dlq_cut, held):
        keep = e.head if e.keep is None else e.keep  # nothing must stay: all of it goes
        minimums[(e.topic, e.queue_id)] = keep
        if keep > e.low:
            moves[(e.topic, e.queue_id)] = keep
            index_rows += keep - e.low
    if moves:
        ctx.commit(partial(consume_queue.trim, wh, moves), what="consume_queue")
    timer_rows = consume_queue.expired_timers(wh, cut, held)
    if timer_rows:
        ctx.commit(partial(consume_queue.delete_expired_timers, wh, cut, held), what="consume_queue")
    return index_rows, timer_rows, len(moves), {q: m for q, m in minimums.items() if m > 0}


def _skip_consumers(ctx: Context, moves: dict[tuple[str, int], int], now: int) -> tuple[int, int]:
    """Group offsets below a queue's minimum (``moves``) skip to it — stored ones, and the
    implicit 0 of a subscribed group that has no row for the queue yet; returns (messages
    skipped, offset rows moved)."""
    if not moves:
        return 0, 0
    wh = ctx.warehouse
    groups = ctx.catalog.groups()
    positions = group_positions(wh, moves)
    for sub in ctx.catalog.subscriptions():
        cfg = groups.get(sub.consumer_group)
        if cfg is None:
            continue
        clients = list(cfg.instances or []) if cfg.mode == "BROADCASTING" else [""]
        for client in clients:
            for topic, qid in moves:
                if topic == sub.topic:
                    positions.setdefault(QueueKey(sub.consumer_group, client, topic, qid), 0)
    behind = {k: v for k, v in positions.items() if (k[2], k[3]) in moves and v < moves[(k[2], k[3])]}
    if not behind:
        return 0, 0
    skipped = sum(moves[(t, q)] - v for (_, _, t, q), v in behind.items())
    merge = OffsetsMerge(("next_offset",), now)
    for g, c, t, q in sorted(behind):
        merge.add(g, t, q, c, next_offset=moves[(t, q)])
    moved = "coalesce(t.next_offset, 0) < s.next_offset"
    update = {
        "next_offset": forward("next_offset"),
        "delivered_offset": "CASE WHEN t.delivered_offset IS NULL THEN NULL "
        "ELSE greatest(t.delivered_offset, s.next_offset) END",
        # a head moved past starts afresh, as after any offset move (Catalog.set_offsets):
        # the removed head's attempts, suspends and pause are not the next message's
        **fresh_head(when=moved),
    }
    insert = {"next_offset": source("next_offset")}
    ctx.commit(partial(merge.execute, wh, update, insert), what="offsets")
    return skipped, len(behind)


# --- 2. the bodies ----------------------------------------------------------------------------
def _trim_bodies(ctx: Context, cut: int, dlq_cut: int) -> tuple[int, int, int]:
    """Old commit_log days lose the rows no index row points at, but for dead letters'
    resent copies stored since ``dlq_cut``: `dlq resend` knows a dead letter resent by its
    copy, which must last as long as the dead letter. Returns (days trimmed, rows removed,
    old batches kept for remaining index rows)."""
    wh = ctx.warehouse
    cut_day = ids.store_date(cut)
    # the snapshot the deletes run on is loaded first: every commit it holds that dispatch
    # had not read is among those listed next (a commit landing in an old day between the
    # two reads would otherwise be deleted unindexed)
    table = wh.delta_rs("commit_log")
    # days that still hold rows dispatch has not indexed are left alone
    undispatched = consume_queue.undispatched_days(wh)
    days = [d for d in commit_log.days_before(wh, cut_day) if d.isoformat() not in undispatched]
    if not days:
        return 0, 0, 0
    pointed_at = consume_queue.batches_before(wh, cut_day)
    needed = {d: pointed_at.get(d, set()) for d in days}
    removed = kept = 0
    for day in sorted(days):
        keep = sorted(set(needed[day]))
        predicate = f"store_date = '{day.isoformat()}'"
        if keep:
            predicate += " AND batch_id NOT IN (" + ", ".join(str(int(b)) for b in keep) + ")"
        # written so that a row of no producer group is deleted (NOT over a NULL keeps it)
        predicate += (
            f" AND (producer_group IS NULL OR producer_group <> '{RESEND_PRODUCER_GROUP}'"
            f" OR store_ts < {int(dlq_cut)})"
        )
        metrics = table.delete(predicate)
        removed += int((metrics or {}).get("num_deleted_rows") or 0)
        kept += len(keep)
    return len(days), removed, kept


# --- 3. bookkeeping ---------------------------------------------------------------------------
def _prune_bookkeeping(ctx: Context, now: int) -> dict[str, int]:
    wh = ctx.warehouse
    cfg = ctx.config
    out: dict[str, int] = {}
    cut = ids.store_date(now - cfg.job_runs_reserved_time_ms).isoformat()
    conds = {
        "job_runs": f"run_date < DATE'{cut}'",
        "dq_results": f"run_ts < {sql_long(now - cfg.dq_reserved_time_ms)}",
        # pull clients that died without close(): silent past the client timeout, they hold
        # no queue any more (docs/behaviour.md §6); one that comes back is seen again
        "clients": f"last_seen_ts < {sql_long(now - cfg.client_timeout_ms)}",
    }
    # tables the engine never commits to (OUTSIDE_THE_ENGINE) are pruned by delta-rs
    by_delta_rs = {"job_runs": f"run_date < '{cut}'"}
    assert set(by_delta_rs) == OUTSIDE_THE_ENGINE
    out["consumed_keys"] = dedup.prune(wh, ctx.catalog.groups(), now, policy=cfg.commit_policy, orphans=True)
    for table, cond in conds.items():
        n = _count(ctx, f"SELECT count(*) AS n FROM {wh.ref(table)} WHERE {cond}")
        if n and table in by_delta_rs:
            ctx.commit(partial(wh.delta_rs(table).delete, by_delta_rs[table]), what=table)
        elif n:
            statement = f"DELETE FROM {wh.ref(table)} WHERE {cond}"
            ctx.commit(partial(ctx.engine.execute, statement), what=table)
        out[table] = n
    return out
