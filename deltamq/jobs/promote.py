"""Promote: RocketMQ's ScheduleMessageService (docs/behaviour.md §2) plus absolute timers.

**Delay levels.** ``SCHEDULE_TOPIC_XXXX`` queue ``level - 1`` holds the messages of one
level in store order, which is due order (one level, one delay). For every level, from
the level's saved offset and in offset order, each due entry is re-stored as a new
message in its ``REAL_TOPIC`` / ``REAL_QID`` with ``DELAY``, ``REAL_TOPIC`` and
``REAL_QID`` removed; the pass stops at the first entry not yet due and the level's
offset then points at it. An entry due later than ``now + delay(level)`` and a minute
(``CLOCK_CORRECTION_SLACK_MS``) is due now (clock correction). An entry whose real
topic is the half topic is skipped (the offset moves past it; nothing is written), as
RocketMQ does.

**Timers** (our extension). Messages with ``TIMER_DELIVER_MS`` sit in the timer index
(``rmq_sys_wheel_timer``), partitioned by due hour. A pass promotes the entries due in
``(watermark, now]`` — reading only those hours' partitions — plus any entry indexed
since the previous pass whose due time is already behind the watermark (it was sent
late). The watermark then moves to ``now``.

All levels and the timers are read in one Spark job per pass, each by partition and
offset/due range, so a pass reads the heads that fall due, not every held entry.

Ids and crash safety: a promoted message's store time is its due time (the pass's ``now``
when that is later: :func:`store_at`), and its id is
``engine_batch_id(due, level | timer kind)`` + its source queue offset — a function of
the schedule entry alone. Outputs are appended first (skipping ids already stored, a
look-up by a batch-id range that file statistics prune), offsets last, so a kill at any
point re-runs to the same result with nothing lost or written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from deltamq import faults, ids
from deltamq.constants import (
    CLOCK_CORRECTION_SLACK_MS,
    DISPATCH_GROUP,
    PROMOTE_GROUP,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_HALF_TOPIC,
    Prop,
)
from deltamq.jobs import promote_files
from deltamq.tables import consume_queue
from deltamq.tables.bodies import join_bodies, read_bodies, restore_columns, restored_message, stored_ids
from deltamq.tables.consume_queue import TIMER_SLOT_MS
from deltamq.tables.offsets import ProgressRow, advance_offsets, progress
from deltamq.tables.ranges import any_of, merge_ranges

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.tables.warehouse import Warehouse

JOB = "promote"
_REMOVED_PROPS = (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.TIMER_DELIVER_MS)


@dataclass(frozen=True)
class PromoteState:
    """Per-level next offsets; the timer watermark and the timer queue offset seen."""

    level_offsets: dict[int, int] = field(default_factory=dict)  # schedule queue id -> next offset
    timer_watermark: int = -1
    timer_next_offset: int = 0


@dataclass(frozen=True, kw_only=True)
class PromoteResult:
    rows_in: int
    rows_out: int
    by_level: dict[int, int]
    timers: int
    skipped_half: int
    already_stored: int
    indexed: int = 0  # copies indexed by this pass (the rest wait for dispatch)
    due_now: int = 0  # entries handled that were due at the pass's now (the rest: promoted ahead)
    due_queues: frozenset[tuple[str, int]] | None = None  # their real queues (None: not all known)
    progress: Progress | None = None  # left to the caller to commit (``defer_progress``)

    @property
    def details(self) -> dict[str, int]:
        out = {f"level_{lvl}": n for lvl, n in sorted(self.by_level.items())}
        return out | {
            "timers": self.timers,
            "skipped_half": self.skipped_half,
            "already_stored": self.already_stored,
            "indexed": self.indexed,
            "ahead": self.rows_in - self.skipped_half - self.due_now,
        }


@dataclass
class Memory:
    """What a runner's promote remembers between passes: the state its last pass left
    committed, so the next pass need not read it. Offsets only move forward, so the
    table holds this state or a later one (another runner's pass); a pass starting from
    an earlier state only finds those entries' copies already stored. Forgotten when a
    pass starts, remembered again once its progress is committed."""

    state: PromoteState | None = None

    def take(self) -> PromoteState | None:
        known, self.state = self.state, None
        return known


def load_state(wh: Warehouse) -> PromoteState:
    levels: dict[int, int] = {}
    watermark, timer_next = -1, 0
    for r in progress(wh, {PROMOTE_GROUP: None})[PROMOTE_GROUP]:
        if r.topic == SCHEDULE_TOPIC:
            levels[r.queue_id] = r.next_offset or 0
        elif r.topic == TIMER_TOPIC:
            timer_next = r.next_offset or 0
            watermark = r.progress_version if r.progress_version is not None else -1
    return PromoteState(levels, watermark, timer_next)


# --- reading ------------------------------------------------------------------------------
def read_candidates(
    wh: Warehouse, state: PromoteState, levels: list[tuple[int, int]], now: int, until: int
) -> DataFrame:
    """consume_queue rows that may be due by ``until`` (``now`` plus ``promote_ahead_ms``):
    every level's head (partition = level, offset ≥ saved, due ≤ until or clock-corrected
    at ``now``) and the timers due since the watermark."""
    cq = wh.read("consume_queue")
    level_preds = []
    for level, delay_ms in levels:
        q = level - 1
        level_preds.append(
            (F.col("slot") == q)
            & (F.col("queue_offset") >= F.lit(state.level_offsets.get(q, 0)))
            & (
                (F.col("due_ts") <= F.lit(until))
                | (F.col("due_ts") > F.lit(promote_files.corrected_after(now, delay_ms)))
            )
        )
    wm = state.timer_watermark
    window = (
        (F.col("slot") >= F.lit(max(wm, 0) // TIMER_SLOT_MS))
        & (F.col("slot") <= F.lit(until // TIMER_SLOT_MS))
        & (F.col("due_ts") > F.lit(wm))
        & (F.col("due_ts") <= F.lit(until))
    )
    late = (F.col("queue_offset") >= F.lit(state.timer_next_offset)) & (F.col("due_ts") <= F.lit(wm))
    pred = ((F.col("topic") == F.lit(SCHEDULE_TOPIC)) & any_of(level_preds)) | (
        (F.col("topic") == F.lit(TIMER_TOPIC)) & (window | late)
    )
    return cq.where(pred)


# --- planning (pure) ----------------------------------------------------------------------
def plan_due(candidates: DataFrame, level_offsets: DataFrame) -> DataFrame:
    """Pure plan: candidates → the entries to promote now.

    Schedule entries: only the run of consecutive offsets starting at the level's saved
    offset (the pass stops at the first entry not yet due). Timers: all candidates.
    Adds ``kind`` (engine batch kind), ``src_offset`` and ``skip`` (half-topic entries).
    """
    base = level_offsets.select(F.col("queue_id").alias("b_qid"), F.col("next_offset").alias("base"))
    sched = candidates.where(F.col("topic") == F.lit(SCHEDULE_TOPIC)).join(
        F.broadcast(base), F.col("queue_id") == F.col("b_qid"), "left"
    )
    rn = F.row_number().over(Window.partitionBy("queue_id").orderBy("queue_offset"))
    sched = (
        sched.withColumn("rn", rn)
        .where(F.col("queue_offset") - F.coalesce(F.col("base"), F.lit(0)) == F.col("rn") - 1)
        .drop("rn", "b_qid", "base")
        .withColumn("kind", (F.col("queue_id") + 1).cast("bigint"))
    )
    timers = candidates.where(F.col("topic") == F.lit(TIMER_TOPIC)).withColumn(
        "kind", F.lit(ids.KIND_TIMER).cast("bigint")
    )
    due = sched.unionByName(timers)
    real_topic = F.col("properties").getItem(Prop.REAL_TOPIC)
    return due.withColumn("skip", real_topic.isNull() | (real_topic == F.lit(TRANS_HALF_TOPIC)))


def store_at(now: int, levels: list[tuple[int, int]]) -> Column:
    """A due entry's copy's store time, which is when consumers may have it (its index
    row carries it as ``due_ts``): its due time, or ``now`` when that is later (a timer
    sent with a due time already past, entries that fell due while no tick ran), as
    RocketMQ stores a promoted message when it promotes it, so that retention counts a
    copy's age from when it became a message; for a delay-level entry due later than
    ``now`` plus its level's delay and :data:`CLOCK_CORRECTION_SLACK_MS` (RocketMQ's clock
    correction: a producer clock far ahead), ``now``. Decided here, once, so that no
    later indexing pass decides it."""
    delay = F.create_map(*[x for lvl, ms in levels for x in (F.lit(lvl - 1), F.lit(ms).cast("bigint"))])
    corrected = (F.col("topic") == F.lit(SCHEDULE_TOPIC)) & (
        F.col("due_ts")
        > F.lit(now + CLOCK_CORRECTION_SLACK_MS)
        + F.coalesce(F.element_at(delay, F.col("queue_id")), F.lit(0))
    )
    return F.when(corrected, F.lit(now).cast("bigint")).otherwise(
        F.greatest(F.col("due_ts"), F.lit(now).cast("bigint"))
    )


def plan_messages(due: DataFrame, bodies: DataFrame) -> DataFrame:
    """Pure plan: due entries (with ``store_at``, :func:`store_at`) + their commit_log rows →
    new commit_log rows in the real topic and queue, ids derived from the entry (batch =
    due time and kind, position = its offset), stored at ``store_at``."""
    src = due.where(~F.col("skip")).select(
        "kind",
        F.col("queue_offset").alias("src_offset"),
        F.col("due_ts"),
        F.col("store_at"),
        F.col("properties").getItem(Prop.REAL_TOPIC).alias("real_topic"),
        F.col("properties").getItem(Prop.REAL_QID).cast("int").alias("real_qid"),
        F.col("cl_batch_id"),
        F.col("cl_batch_pos"),
        F.col("msg_id").alias("src_msg_id"),
    )
    joined = join_bodies(src, bodies, restore_columns(), msg_id="src_msg_id")
    batch = ids.engine_batch_id_col(F.col("due_ts"), F.col("kind"))
    pos = F.col("src_offset").bitwiseAND(F.lit(0xFFFFFFFF))
    props = F.map_filter(
        F.coalesce(F.col("orig_props"), F.create_map().cast("map<string,string>")),
        lambda k, v: ~k.isin(*_REMOVED_PROPS),
    )
    return restored_message(
        joined,
        msg_id=ids.msg_id_col(batch, pos),
        topic=F.col("real_topic"),
        queue_id=F.col("real_qid"),
        properties=props,
        store_ts=F.col("store_at"),
        reconsume_times=F.col("orig_reconsume"),
        batch_id=batch,
        batch_pos=pos,
    )


# --- running ------------------------------------------------------------------------------
DispatchHint = tuple[int, dict[tuple[str, int], int]]
"""What dispatch's hint becomes when promote indexed its copies: the commit_log version
reached and the next offset of each queue the hint must carry."""


@dataclass
class _DueSummary:
    """What the due entries of a pass come to (one statement: :func:`_summary_sql`)."""

    n_in: int = 0
    skipped: int = 0
    timers: int = 0
    by_level: dict[int, int] = field(default_factory=dict)
    new_levels: dict[int, int] = field(default_factory=dict)  # schedule queue id -> next offset
    timer_hi: int | None = None
    keys: set[tuple[int, date, int]] = field(default_factory=set)  # (cl_batch_id, cl_date, due_ts)
    # the days a copy may have been stored on: its store date, and for a copy stored at a
    # pass's now (not its due time) every day from its entry's (a killed pass's copies)
    store_days: set[date] = field(default_factory=set)
    by_queue: dict[tuple[str, int], int] = field(default_factory=dict)  # real queue -> copies
    due_now: int = 0  # entries to copy that were due at the pass's now
    due_queues: set[tuple[str, int]] = field(default_factory=set)  # and their real queues
    queues_known: bool = True  # every copy's real queue parsed


def _summary(wh: Warehouse, state: PromoteState, due: DataFrame) -> DataFrame:
    """The due entries grouped by what the pass needs (counts and offsets per source queue,
    the bodies' keys, the copies per real queue), and a row with the timer queue's last
    offset (``topic`` NULL): one statement."""
    props = F.col("properties")
    keys = list(promote_files.SUMMARY_KEYS)
    grouped = (
        due.select(
            *keys[:3],
            props.getItem(Prop.REAL_TOPIC).alias("real_topic"),
            props.getItem(Prop.REAL_QID).alias("real_qid"),
            *keys[5:],
            "queue_offset",
        )
        .groupBy(*[F.col(k) for k in keys])  # columns, not names: no schema round trip
        .agg(F.count(F.lit(1)).alias("n"), F.max("queue_offset").alias("hi"))
    )
    types = ["string", "int", "boolean", "string", "string", "bigint", "date", "bigint", "bigint", "bigint"]
    timer_hi = (
        wh.read("consume_queue")
        .where(
            (F.col("topic") == F.lit(TIMER_TOPIC)) & (F.col("queue_offset") >= F.lit(state.timer_next_offset))
        )
        .agg(F.max("queue_offset").alias("hi"))
        .select(*[F.lit(None).cast(t).alias(c) for c, t in zip([*keys, "n"], types, strict=True)], "hi")
    )
    return grouped.unionByName(timer_hi)


def _summarise(rows: list[Any], now: int) -> _DueSummary:
    """The due entries' summary rows summed up; an entry whose copy is stored by ``now``
    (:func:`store_at`: due by then, or promoted by clock correction) counts as due now."""
    s = _DueSummary()
    for r in rows:
        if r["topic"] is None:  # the timer queue's last offset
            s.timer_hi = r["hi"]
            continue
        n = r["n"]
        s.n_in += n
        if r["topic"] == SCHEDULE_TOPIC:
            level = r["queue_id"] + 1
            s.by_level[level] = s.by_level.get(level, 0) + n
            s.new_levels[r["queue_id"]] = max(s.new_levels.get(r["queue_id"], 0), r["hi"] + 1)
        else:
            s.timers += n
        if r["skip"]:
            s.skipped += n
            continue
        s.keys.add((r["cl_batch_id"], r["cl_date"], r["due_ts"]))
        if r["store_at"] is not None:
            s.store_days |= _copy_days(r["cl_date"], r["due_ts"], r["store_at"])
        due_now = r["store_at"] is None or r["store_at"] <= now
        s.due_now += n if due_now else 0
        try:
            queue = (r["real_topic"], int(r["real_qid"]))
        except (TypeError, ValueError):
            s.queues_known = False
            continue
        s.by_queue[queue] = s.by_queue.get(queue, 0) + n
        if due_now:
            s.due_queues.add(queue)
    return s


def _copy_days(entry_day: date | str, due: int, store_at: int) -> set[date]:
    """The days an entry's copy may be stored on: the day of ``store_at``; when that is a
    pass's ``now`` rather than the due time, an earlier pass killed after writing the copy
    stored it at its own now, on a day from the entry's store day on."""
    last = ids.store_date(store_at)
    if store_at == due:
        return {last}
    first = entry_day if isinstance(entry_day, date) else date.fromisoformat(str(entry_day))
    return {first + timedelta(days=k) for k in range(max(0, (last - first).days) + 1)} | {last}


def _copy_id(due: DataFrame) -> DataFrame:
    """The msg ids :func:`plan_messages` gives the copies of ``due``'s entries (no bodies read)."""
    batch = ids.engine_batch_id_col(F.col("due_ts"), F.col("kind"))
    pos = F.col("queue_offset").bitwiseAND(F.lit(0xFFFFFFFF))
    return due.where(~F.col("skip")).select(ids.msg_id_col(batch, pos).alias("msg_id"))


def run(
    ctx: Context,
    now: int,
    *,
    fence: Callable[[], None] | None = None,
    indexes: bool = False,
    defer_progress: bool = False,
    memory: Memory | None = None,
) -> PromoteResult:
    """Promote everything due by ``now`` plus ``promote_ahead_ms``; outputs first,
    offsets last. Copies of entries due after ``now`` are written and indexed now, each
    index row carrying its due time, and no reader of the queue hands them out before
    it (``consume_queue.visible_heads``): a timer is in its queue when it falls due.

    ``fence`` is called before the output commit (lease check). ``indexes``: the caller
    holds dispatch's lease too and ``fence`` checks both (a tick): promote then indexes
    its copies itself (``consume_queue.index_appended``), so no second dispatch is
    needed; otherwise the copies wait for the next dispatch. ``defer_progress``: the
    progress commit is left to the caller (the result's ``progress``, committed with
    :func:`commit_progress`), which a tick does after deliver so the copies reach their
    listeners one commit sooner; outputs are committed by then, and a progress commit
    that never runs (a kill, a failed step) only makes the next pass find its copies
    already stored. Without it, or when nothing was indexed, the pass commits its
    progress itself. ``memory``: the state the runner's last pass left committed
    (:class:`Memory`), updated once the progress is committed.
    """
    wh = ctx.warehouse
    levels = wh.levels()
    state = (memory.take() if memory is not None else None) or load_state(wh)
    until = now + ctx.promote_ahead_ms
    # the due entries from the tables' files (promote_files), or through the engine
    found = promote_files.due_entries(
        wh, state.level_offsets, state.timer_watermark, state.timer_next_offset, levels, now, until
    )
    prepared = None if found is None else _prepare_from_files(ctx, *found, now)
    if prepared is not None:
        s, rows, already = prepared
        append: Callable[[], tuple[int, int]] = partial(_append_rows, ctx, rows, s, already, fence)
    else:  # the whole pass through the engine
        due = _due(ctx, state, levels, now, until)
        s = _summarise(_summary(wh, state, due).collect(), now)
        append = partial(_append, ctx, due, s, fence)
    written, already, indexed, hint = _write_copies(ctx, s, levels, append, indexes=indexes)
    timer_next = state.timer_next_offset if s.timer_hi is None else s.timer_hi + 1
    # Nothing handled and no new timers: commit nothing (an idle tick stays idle). The
    # watermark may lag; the next window (watermark, until] still covers what it missed.
    left: Progress | None = None
    if s.new_levels or timer_next != state.timer_next_offset or s.timers:
        left = Progress(state, s.new_levels, until, timer_next, hint)
        if not (defer_progress and indexed):
            commit_progress(ctx, left, memory)
            left = None
    else:
        if memory is not None:
            memory.state = state
        faults.point("promote.after_progress_commit")
    return PromoteResult(
        rows_in=s.n_in,
        rows_out=written,
        by_level=s.by_level,
        timers=s.timers,
        skipped_half=s.skipped,
        already_stored=already,
        indexed=indexed,
        due_now=s.due_now,
        due_queues=frozenset(s.due_queues) if s.queues_known else None,
        progress=left,
    )


def _due(ctx: Context, state: PromoteState, levels: list[tuple[int, int]], now: int, until: int) -> DataFrame:
    """The entries to promote, through the engine (:func:`plan_due`, with ``store_at``)."""
    base = ctx.engine.spark.createDataFrame(
        [(q, o) for q, o in sorted(state.level_offsets.items())], "queue_id int, next_offset bigint"
    )
    candidates = read_candidates(ctx.warehouse, state, levels, now, until)
    return plan_due(candidates, base).withColumn("store_at", store_at(now, levels))


def _append(
    ctx: Context, due: DataFrame, s: _DueSummary, fence: Callable[[], None] | None
) -> tuple[int, int]:
    """Append, through the engine, the copies of the ``due`` entries not stored yet;
    returns (copies written, copies found already stored)."""
    wh = ctx.warehouse
    # Bodies and already-stored ids are looked up by narrow batch-id ranges (store
    # times of the entries, and their due times), so the reads follow what falls due.
    bodies = read_bodies(wh, (k[1] for k in s.keys), (k[0] for k in s.keys))
    messages = plan_messages(due, bodies)
    stored = stored_ids(wh, merge_ranges([k[2] for k in s.keys], gap=60_000), s.store_days)
    # copies a pass killed before its progress commit left behind (ids are derived)
    already = _copy_id(due).join(stored, "msg_id", "left_semi").count()
    written = s.n_in - s.skipped - already
    faults.point("promote.before_output_commit")
    if written:
        # with both leases checked here (``indexes``), the index commit that follows
        # at once needs no second check: its MERGE finds rows a racing dispatcher wrote
        if fence:
            fence()
        out = messages if not already else messages.join(stored, "msg_id", "left_anti")
        ctx.commit(lambda: wh.append("commit_log", out), what=JOB)
    return written, already


def _prepare_from_files(
    ctx: Context, entries: list[dict[str, Any]], timer_hi: int | None, now: int
) -> tuple[_DueSummary, pa.Table | None, int] | None:
    """The pass's summary, the copies to append and how many were stored already, from
    the tables' files (promote_files); None when the files cannot say, and the whole
    pass goes through the engine."""
    wh = ctx.warehouse
    s = _summarise(promote_files.summary_rows(entries, timer_hi), now)
    if s.n_in - s.skipped <= 0:
        return s, None, 0
    stored = promote_files.stored_ids(wh, merge_ranges([k[2] for k in s.keys], gap=60_000), s.store_days)
    rows = None if stored is None else promote_files.copies(wh, entries, stored)
    if stored is None or rows is None:
        return None
    already = sum(1 for e in entries if not e["skip"] and promote_files.copy_id(e) in stored)
    return s, rows, already


def _append_rows(
    ctx: Context, rows: pa.Table | None, s: _DueSummary, already: int, fence: Callable[[], None] | None
) -> tuple[int, int]:
    """:func:`_append` of copies built from the files (:func:`_prepare_from_files`)."""
    written = s.n_in - s.skipped - already
    faults.point("promote.before_output_commit")
    if written and rows is not None:
        if fence:
            fence()
        ctx.append_commit_log(rows, what=JOB)
    return written, already


def _write_copies(
    ctx: Context,
    s: _DueSummary,
    levels: list[tuple[int, int]],
    append: Callable[[], tuple[int, int]],
    *,
    indexes: bool,
) -> tuple[int, int, int, DispatchHint | None]:
    """Append the copies of the due entries that are not stored yet (outputs first:
    ``append``), and index them when the caller holds dispatch's lease too
    (``indexes``); returns (copies written, copies found already stored, copies
    indexed, dispatch's hint)."""
    wh = ctx.warehouse
    if s.n_in - s.skipped <= 0:
        return 0, 0, 0, None
    written, already = append()
    faults.point("promote.after_output_commit")
    if not (written and not already and indexes and s.queues_known):
        return written, already, 0, None
    done = ctx.commit(
        lambda: consume_queue.index_appended(wh, levels, written, s.by_queue, job=JOB),
        what="dispatch",
    )
    if done is None:
        return written, already, 0, None
    return written, already, done.rows_out, (done.to_version, done.queues)


@dataclass(frozen=True)
class Progress:
    """A pass's progress, to commit: the state it started from, the levels' new next
    offsets, the due watermark reached (``now``), the timer queue's next offset, and
    dispatch's hint when the pass indexed its copies."""

    start: PromoteState
    levels: dict[int, int]
    watermark: int
    timer_next: int
    dispatch_hint: DispatchHint | None = None

    def after(self) -> PromoteState:
        """The state once committed (values only move forward, as in the MERGE)."""
        levels = dict(self.start.level_offsets)
        for q, o in self.levels.items():
            levels[q] = max(levels.get(q, 0), o)
        return PromoteState(
            levels,
            max(self.start.timer_watermark, self.watermark),
            max(self.start.timer_next_offset, self.timer_next),
        )


def commit_progress(ctx: Context, progress: Progress, memory: Memory | None = None) -> None:
    """Commit a pass's :class:`Progress` (and remember it in ``memory``)."""
    ctx.commit(
        lambda: write_progress(
            ctx.warehouse,
            progress.levels,
            progress.watermark,
            progress.timer_next,
            progress.watermark,
            dispatch_hint=progress.dispatch_hint,
        ),
        what="offsets",
    )
    if memory is not None:
        memory.state = progress.after()
    faults.point("promote.after_progress_commit")


def write_progress(
    wh: Warehouse,
    levels: dict[int, int],
    watermark: int,
    timer_next: int,
    now: int,
    *,
    dispatch_hint: DispatchHint | None = None,
) -> None:
    """Per-level next offsets; the timer queue offset seen and the due watermark; and,
    when promote indexed its copies, dispatch's hint (version reached, queue heads) in
    the same commit."""
    rows: list[ProgressRow] = [(SCHEDULE_TOPIC, q, o, None) for q, o in sorted(levels.items())]
    rows.append((TIMER_TOPIC, 0, timer_next, watermark))
    also: dict[str, list[ProgressRow]] = {}
    if dispatch_hint is not None:
        version, heads = dispatch_hint
        also[DISPATCH_GROUP] = [("", -1, None, version)] + [
            (t, q, o, None) for (t, q), o in sorted(heads.items())
        ]
    advance_offsets(wh, PROMOTE_GROUP, rows, now, also=also)
