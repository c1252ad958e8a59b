"""Promote: RocketMQ's ScheduleMessageService (docs/behaviour.md §2) plus absolute timers.

**Delay levels.** ``SCHEDULE_TOPIC_XXXX`` queue ``level - 1`` holds the messages of one
level in store order, which is due order (one level, one delay). For every level, from
the level's saved offset and in offset order, each due entry is re-stored as a new
message in its ``REAL_TOPIC`` / ``REAL_QID`` with ``DELAY``, ``REAL_TOPIC`` and
``REAL_QID`` removed; the pass stops at the first entry not yet due and the level's
offset then points at it. An entry due later than ``now + delay(level)`` is due now
(clock correction). An entry whose real topic is the half topic is skipped (the offset
moves past it; nothing is written), as RocketMQ does.

**Timers** (our extension). Messages with ``TIMER_DELIVER_MS`` sit in the timer index
(``rmq_sys_wheel_timer``), partitioned by due hour. A pass promotes the entries due in
``(watermark, now]`` — reading only those hours' partitions — plus any entry indexed
since the previous pass whose due time is already behind the watermark (it was sent
late). The watermark then moves to ``now``.

All levels and the timers are read in one Spark job per pass, each by partition and
offset/due range, so a pass reads the heads that fall due, not every held entry.

Ids and crash safety: a promoted message's store time is its due time, and its id is
``engine_batch_id(due, level | timer kind)`` + its source queue offset — a function of
the schedule entry alone. Outputs are appended first (skipping ids already stored, a
look-up by a batch-id range that file statistics prune), offsets last, so a kill at any
point re-runs to the same result with nothing lost or written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from deltamq import faults, ids
from deltamq.constants import PROMOTE_GROUP, SCHEDULE_TOPIC, TIMER_TOPIC, TRANS_HALF_TOPIC, Prop
from deltamq.jobs.dispatch import TIMER_SLOT_MS
from deltamq.tables.bodies import join_bodies, read_bodies, restore_columns, restored_message, stored_ids
from deltamq.tables.offsets import ProgressRow, advance_offsets
from deltamq.tables.ranges import any_of, merge_ranges
from deltamq.tables.sqltext import sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

JOB = "promote"
_DUE_VIEW = "dmq_promote_due"
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

    @property
    def details(self) -> dict[str, int]:
        out = {f"level_{lvl}": n for lvl, n in sorted(self.by_level.items())}
        return out | {
            "timers": self.timers,
            "skipped_half": self.skipped_half,
            "already_stored": self.already_stored,
        }


def load_state(wh: Warehouse) -> PromoteState:
    rows = wh.engine.rows(
        f"SELECT topic, queue_id, next_offset, progress_version FROM {wh.ref('offsets')} "
        f"WHERE consumer_group = {sql_str(PROMOTE_GROUP)}"
    )
    levels: dict[int, int] = {}
    watermark, timer_next = -1, 0
    for r in rows:
        if r["topic"] == SCHEDULE_TOPIC:
            levels[r["queue_id"]] = r["next_offset"] or 0
        elif r["topic"] == TIMER_TOPIC:
            timer_next = r["next_offset"] or 0
            watermark = r["progress_version"] if r["progress_version"] is not None else -1
    return PromoteState(levels, watermark, timer_next)


# --- reading ------------------------------------------------------------------------------
def read_candidates(wh: Warehouse, state: PromoteState, levels: list[tuple[int, int]], now: int) -> DataFrame:
    """consume_queue rows that may be due: every level's head (partition = level, offset ≥
    saved, due ≤ now or clock-corrected) and the timers due since the watermark."""
    cq = wh.read("consume_queue")
    level_preds = []
    for level, delay_ms in levels:
        q = level - 1
        level_preds.append(
            (F.col("slot") == q)
            & (F.col("queue_offset") >= F.lit(state.level_offsets.get(q, 0)))
            & ((F.col("due_ts") <= F.lit(now)) | (F.col("due_ts") > F.lit(now + delay_ms)))
        )
    wm = state.timer_watermark
    window = (
        (F.col("slot") >= F.lit(max(wm, 0) // TIMER_SLOT_MS))
        & (F.col("slot") <= F.lit(now // TIMER_SLOT_MS))
        & (F.col("due_ts") > F.lit(wm))
        & (F.col("due_ts") <= F.lit(now))
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


def plan_messages(due: DataFrame, bodies: DataFrame) -> DataFrame:
    """Pure plan: due entries + their commit_log rows → new commit_log rows in the real
    topic and queue, ids and store times derived from the entry (store time = due time)."""
    src = due.where(~F.col("skip")).select(
        "kind",
        F.col("queue_offset").alias("src_offset"),
        F.col("due_ts"),
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
        store_ts=F.col("due_ts"),
        reconsume_times=F.col("orig_reconsume"),
        batch_id=batch,
        batch_pos=pos,
    )


# --- running ------------------------------------------------------------------------------
def run(wh: Warehouse, now: int, *, fence=None) -> PromoteResult:
    """Promote everything due at ``now``; outputs first, offsets last."""
    engine = wh.engine
    spark = engine.spark
    levels = wh.levels()
    state = load_state(wh)
    candidates = read_candidates(wh, state, levels, now)
    base = spark.createDataFrame(
        [(q, o) for q, o in sorted(state.level_offsets.items())], "queue_id int, next_offset bigint"
    )
    due = plan_due(candidates, base)
    due.createOrReplaceTempView(_DUE_VIEW)
    summary = engine.rows(
        f"SELECT topic, queue_id, count(*) AS n, sum(CASE WHEN skip THEN 1 ELSE 0 END) AS skipped, "
        f"max(queue_offset) AS hi FROM {_DUE_VIEW} GROUP BY topic, queue_id"
    )
    timer_hi = engine.rows(
        f"SELECT max(queue_offset) AS hi FROM {wh.ref('consume_queue')} "
        f"WHERE topic = {sql_str(TIMER_TOPIC)} AND queue_offset >= {sql_long(state.timer_next_offset)}"
    )[0]["hi"]
    n_in = sum(r["n"] for r in summary)
    skipped = sum(r["skipped"] for r in summary)
    by_level = {r["queue_id"] + 1: r["n"] for r in summary if r["topic"] == SCHEDULE_TOPIC}
    timers = sum(r["n"] for r in summary if r["topic"] == TIMER_TOPIC)
    written = already = 0
    if n_in - skipped > 0:
        # Bodies and already-stored ids are looked up by narrow batch-id ranges (store
        # times of the entries, and their due times), so the reads follow what falls due.
        keys = engine.rows(f"SELECT DISTINCT cl_batch_id, cl_date, due_ts FROM {_DUE_VIEW} WHERE NOT skip")
        bodies = read_bodies(wh, (r["cl_date"] for r in keys), (r["cl_batch_id"] for r in keys))
        messages = plan_messages(spark.table(_DUE_VIEW), bodies)
        stored = stored_ids(wh, merge_ranges([r["due_ts"] for r in keys], gap=60_000))
        fresh = messages.join(stored, "msg_id", "left_anti")
        fresh.createOrReplaceTempView("dmq_promote_out")
        written = engine.rows("SELECT count(*) AS n FROM dmq_promote_out")[0]["n"]
        already = n_in - skipped - written
        faults.point("promote.before_output_commit")
        if written:
            if fence:
                fence()
            out = spark.table("dmq_promote_out")
            engine.commit(lambda: wh.append("commit_log", out), what=JOB)
        faults.point("promote.after_output_commit")
    new_levels = {r["queue_id"]: r["hi"] + 1 for r in summary if r["topic"] == SCHEDULE_TOPIC and r["n"]}
    timer_next = state.timer_next_offset if timer_hi is None else timer_hi + 1
    # Nothing handled and no new timers: commit nothing (an idle tick stays idle). The
    # watermark may lag; the next window (watermark, now] still covers what it missed.
    if new_levels or timer_next != state.timer_next_offset or timers:
        engine.commit(lambda: write_progress(wh, new_levels, now, timer_next, now), what="offsets")
    faults.point("promote.after_progress_commit")
    return PromoteResult(
        rows_in=n_in,
        rows_out=written,
        by_level=by_level,
        timers=timers,
        skipped_half=skipped,
        already_stored=already,
    )


def write_progress(wh: Warehouse, levels: dict[int, int], watermark: int, timer_next: int, now: int) -> None:
    """Per-level next offsets; the timer queue offset seen and the due watermark."""
    rows: list[ProgressRow] = [(SCHEDULE_TOPIC, q, o, None) for q, o in sorted(levels.items())]
    rows.append((TIMER_TOPIC, 0, timer_next, watermark))
    advance_offsets(wh, PROMOTE_GROUP, rows, now)


def pending(wh: Warehouse) -> dict[str, list[dict]]:
    """What is held: per level (pending, oldest due, saved offset) and timers by due day."""
    state = load_state(wh)
    cq = wh.ref("consume_queue")
    levels = wh.levels()
    held_levels = (
        " OR ".join(
            f"(slot = {lvl - 1} AND queue_offset >= {sql_long(state.level_offsets.get(lvl - 1, 0))})"
            for lvl, _ in levels
        )
        or "FALSE"
    )
    rows = {
        r["queue_id"]: r
        for r in wh.engine.rows(
            f"SELECT queue_id, count(*) AS n, min(due_ts) AS oldest_due FROM {cq} "
            f"WHERE topic = {sql_str(SCHEDULE_TOPIC)} AND ({held_levels}) GROUP BY queue_id"
        )
    }
    per_level = [
        {
            "level": lvl,
            "delay_ms": delay,
            "offset": state.level_offsets.get(lvl - 1, 0),
            "pending": rows[lvl - 1]["n"] if lvl - 1 in rows else 0,
            "oldest_due": rows[lvl - 1]["oldest_due"] if lvl - 1 in rows else None,
        }
        for lvl, delay in levels
    ]
    timers = wh.engine.rows(
        f"SELECT date_from_unix_date(CAST(floor(due_ts / {ids.DAY_MS}) AS INT)) AS due_day, count(*) AS n, "
        f"min(due_ts) AS first_due FROM {cq} WHERE topic = {sql_str(TIMER_TOPIC)} "
        f"AND (due_ts > {sql_long(state.timer_watermark)} "
        f"OR queue_offset >= {sql_long(state.timer_next_offset)}) GROUP BY 1 ORDER BY 1"
    )
    return {
        "levels": per_level,
        "timers": [
            {"due_day": str(r["due_day"]), "pending": r["n"], "first_due": r["first_due"]} for r in timers
        ],
    }
