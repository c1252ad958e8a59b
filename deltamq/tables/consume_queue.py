"""The ``consume_queue`` table's one owner: indexing new ``commit_log`` rows, and every
SQL statement over the index.

**Indexing** (RocketMQ's reput; docs/design.md, "How dispatch finds new rows").
:func:`index_new` indexes the ``commit_log`` commits after the index's version: it
reads only the files those commits added (``commit_log.read_added``), routes each row
(:func:`plan_index`), and inserts the rows in one MERGE keyed on ``msg_id`` within the
version range. Rows are ordered by (commit version, producer batch, position); offsets
are dense per queue and a deterministic function of that order. The version each row
came from is written in the row itself (``cl_version``), so the index and its progress
commit atomically; the ``%DISPATCH%`` rows of ``offsets`` are a hint the caller writes
afterwards (:func:`load_dispatch_state` corrects a hint that lags).

:func:`index_appended` is the same indexing for a caller that has just appended one
commit of its own (promote's copies), done only when that commit is the one commit the
index lacks: the rows are then exactly those :func:`index_new` would write. Dispatch
and promote both index through here; neither knows the other.

Routing (docs/behaviour.md §2, §5): transactional half messages → ``RMQ_SYS_TRANS_HALF_TOPIC``
queue 0; messages with ``TIMER_DELIVER_MS`` → the timer index (``rmq_sys_wheel_timer``)
with their due time; ``DELAY`` > 0 → ``SCHEDULE_TOPIC_XXXX`` queue ``level - 1``
(level clamped to the maximum), due at ``store_ts + delay(level)``. Routed rows keep
their real topic and queue in ``REAL_TOPIC`` / ``REAL_QID``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date
from typing import TYPE_CHECKING, Any, NamedTuple

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from deltamq import faults, file_reads, ids
from deltamq.constants import (
    DLQ_PREFIX,
    ENDS_LOOKBACK_MS,
    RETRY_PREFIX,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Prop,
    SysFlag,
)
from deltamq.schemas import TABLES
from deltamq.tables import commit_log, deltalog, index_files
from deltamq.tables.offsets import dispatch_hint
from deltamq.tables.sqltext import sql_in, sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

TIMER_SLOT_MS = 3_600_000  # the timer index is partitioned by due hour
ROUTES = ("plain", "schedule", "timer", "half")
_HEADS_SCHEMA = "topic string, queue_id int, next_offset bigint"
# the route of an index row, by the topic it was indexed under (plan_index's routes)
_ROUTE_OF_TOPIC = {TRANS_HALF_TOPIC: "half", TIMER_TOPIC: "timer", SCHEDULE_TOPIC: "schedule"}

Queue = tuple[str, int]
"""(topic, queue_id)."""


@dataclass(frozen=True)
class DispatchState:
    """Where the index stands: the last commit_log version indexed, the next offset of
    every queue, and the heads dispatch's hint lacked (``stale``)."""

    version: int
    heads: dict[Queue, int] = field(default_factory=dict)
    stale: dict[Queue, int] = field(default_factory=dict)


def load_dispatch_state(wh: Warehouse) -> DispatchState:
    """Dispatch's hint (``offsets.dispatch_hint``) corrected by the index rows newer than
    it: the queue heads every reader of the index uses."""
    version, recorded = dispatch_hint(wh)
    return DispatchState(*file_reads.corrected(version, recorded, _heads_after(wh, version)))


def undispatched_days(wh: Warehouse) -> set[str]:
    """The ``store_date`` partitions of ``commit_log`` holding rows of commits dispatch has
    not read yet. Load the snapshot a change is made on first: every commit in it that
    dispatch had not read by then is among those listed here."""
    commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), load_dispatch_state(wh).version, 10**9)
    return {
        day for c in commits for f in c.files if (day := f.partition_values.get("store_date")) is not None
    }


def _heads_after(wh: Warehouse, version: int) -> list[dict[str, Any]]:
    """Per queue with index rows from commit_log versions after ``version``: its next
    offset and the latest such version (``next_offset``, ``v``); from the tables' files
    (deltamq/file_reads.py), else through the engine."""
    found = file_reads.heads_after(wh, version)
    if found is not None:
        return found
    return [
        r.asDict()
        for r in wh.engine.rows(
            f"SELECT topic, queue_id, max(queue_offset) + 1 AS next_offset, max(cl_version) AS v "
            f"FROM {wh.ref('consume_queue')} WHERE cl_version > {sql_long(version)} "
            "GROUP BY topic, queue_id"
        )
    ]


def not_due(wh: Warehouse, now: int) -> dict[Queue, tuple[int, int]]:
    """Per queue of a consumers' topic holding copies promoted ahead that are not due at
    ``now`` (``due_ts`` later than it): the first such offset and the earliest such due
    time. Readers of a queue stop at that offset (:func:`visible_heads`). From the files
    whose statistics allow such rows (deltamq/file_reads.py), else through the engine."""
    found = file_reads.not_due(wh, now)
    if found is not None:
        return found
    return {
        (r["topic"], r["queue_id"]): (r["o"], r["d"])
        for r in wh.engine.rows(
            "SELECT topic, queue_id, min(queue_offset) AS o, min(due_ts) AS d "
            f"FROM {wh.ref('consume_queue')} "
            f"WHERE topic NOT IN {sql_in(file_reads.HELD_TOPICS)} AND due_ts > {sql_long(now)} "
            "GROUP BY topic, queue_id"
        )
    }


def visible_heads(wh: Warehouse, now: int, heads: Mapping[Queue, int] | None = None) -> dict[Queue, int]:
    """Every queue's next offset as its consumers see it at ``now``: the index head
    (``heads``, read when not given), or the first copy promoted ahead that is not due yet
    when one is below it. Deliver, the sinks and pull clients take offsets below this
    only, so no message reaches a consumer before its due time."""
    heads = load_dispatch_state(wh).heads if heads is None else heads
    return file_reads.clamped(heads, not_due(wh, now))


# --- indexing -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Indexed:
    """What an indexing pass did: the commit_log versions it covered, rows in and out,
    rows per route, the next offset of each queue it moved (with heads an earlier pass
    indexed but the hint lacks), and every queue's next offset after it."""

    from_version: int
    to_version: int
    commits_read: int
    rows_in: int
    rows_out: int
    routes: dict[str, int]
    queues: dict[Queue, int]
    duplicate_commits: int = 0  # committed messages of already committed transactions, not indexed
    repeated: int = 0  # messages an ambiguous commit wrote again (already indexed, or twice in the pass)
    heads: dict[Queue, int] = field(default_factory=dict)


def _tran_time_col(tran_id: Column) -> Column:
    """Store time (epoch ms) encoded in a transaction id (the first half's msg id)."""
    return F.shiftright(F.conv(F.substring(tran_id, 1, 16), 16, 10).cast("bigint"), ids.BATCH_RANDOM_BITS)


def drop_duplicate_commits(wh: Warehouse, rows: DataFrame) -> tuple[DataFrame, int]:
    """New rows without the committed messages of transactions already committed.

    A transaction may be ended twice: committed by its producer and by a check pass that
    ran before the producer's end landed (RocketMQ delivers both), or rolled back and then
    committed. The first end wins. Each COMMIT stores the real message and then its op
    record in one commit, so a committed message is dropped when an op record of its
    ``TRAN_ID`` is already indexed, or when an op record or committed message of it comes
    before it among the new rows (by commit version, batch, position): a ROLLBACK's op
    record ahead of a later COMMIT keeps that COMMIT's message out. Op records are looked
    up from the oldest new transaction's start on, less ``ENDS_LOOKBACK_MS`` for an ender's
    clock behind the half's (their batch ids grow with time), so the read follows recent
    history. Returns the rows to index and how many were dropped
    (they stay in commit_log).
    """
    props = F.col("properties")
    # a committed message is stored in its real topic; its retries and dead letters keep
    # TRAN_ID and the committed sys_flag but live in %RETRY% / %DLQ% topics: never dropped
    is_commit = (
        (F.col("sys_flag").bitwiseAND(F.lit(0xC)) == F.lit(SysFlag.TRANSACTION_COMMIT_TYPE))
        & props.getItem(Prop.TRAN_ID).rlike(ids.MSG_ID_PATTERN)
        & (F.col("topic") != F.lit(TRANS_OP_HALF_TOPIC))
        & ~F.col("topic").startswith(RETRY_PREFIX)
        & ~F.col("topic").startswith(DLQ_PREFIX)
    )
    is_op = (F.col("topic") == F.lit(TRANS_OP_HALF_TOPIC)) & props.getItem(Prop.TRAN_ID).rlike(
        ids.MSG_ID_PATTERN
    )
    ends = rows.where(is_commit | is_op).select(
        "msg_id",
        "cl_version",
        "batch_id",
        "batch_pos",
        props.getItem(Prop.TRAN_ID).alias("tran"),
        is_commit.alias("is_commit"),
    )
    commits = ends.where(F.col("is_commit"))
    oldest = commits.agg(F.min(_tran_time_col(F.col("tran"))).alias("t0")).collect()[0]["t0"]
    if oldest is None:
        return rows, 0
    settled = (
        wh.read("consume_queue")
        .where(
            (F.col("topic") == F.lit(TRANS_OP_HALF_TOPIC))
            & (F.col("slot") == F.lit(0))
            & (F.col("cl_batch_id") >= F.lit(max(0, oldest - ENDS_LOOKBACK_MS) << ids.BATCH_RANDOM_BITS))
        )
        .select(F.col("properties").getItem(Prop.TRAN_ID).alias("done_tran"))
        .distinct()
    )
    order = Window.partitionBy("tran").orderBy("cl_version", "batch_id", "batch_pos")
    ranked = ends.withColumn("rn", F.row_number().over(order)).join(
        F.broadcast(settled), F.col("tran") == F.col("done_tran"), "left"
    )
    dups = ranked.where(F.col("is_commit") & ((F.col("rn") > 1) | F.col("done_tran").isNotNull())).select(
        F.col("msg_id").alias("dup_id")
    )
    dropped = dups.count()
    if not dropped:
        return rows, 0
    return rows.join(F.broadcast(dups), F.col("msg_id") == F.col("dup_id"), "left_anti"), dropped


def drop_repeated(wh: Warehouse, rows: DataFrame, commits: list[deltalog.Commit]) -> tuple[DataFrame, int]:
    """New rows without the messages that are already indexed or that an earlier new row
    repeats: what an ambiguous commit leaves behind (a blind append whose write landed
    while its writer saw an error, then written again — by the writer at the next
    version, or by deltamq retrying it with the same ids). Every message keeps one index
    entry, its first. Cheap when nothing repeats: one look-up of the index by the new
    batch ids (file statistics prune it to the newest files). Returns the rows and how
    many were dropped."""
    batches, exact = commit_log.batch_ids(commits)
    found: set[int] = set()
    if batches:
        lo, hi = min(batches), max(batches)
        found = {
            r["b"]
            for r in wh.engine.rows(
                f"SELECT DISTINCT cl_batch_id AS b FROM {wh.ref('consume_queue')} "
                f"WHERE cl_batch_id >= {sql_long(lo)} AND cl_batch_id <= {sql_long(hi)}"
            )
        } & batches
    if exact and not found:
        return rows, 0
    out = rows
    if not exact:
        first = Window.partitionBy("msg_id").orderBy("cl_version", "batch_pos")
        out = out.withColumn("_rn", F.row_number().over(first)).where(F.col("_rn") == 1).drop("_rn")
    if found:
        indexed = (
            wh.read("consume_queue")
            .where(F.col("cl_batch_id").isin(sorted(found)))
            .select(F.col("msg_id").alias("_indexed"))
        )
        out = out.join(F.broadcast(indexed), F.col("msg_id") == F.col("_indexed"), "left_anti")
    before, after = rows.count(), out.count()
    return out, before - after


def int_prop(props: Column, key: str, digits: int) -> Column:
    """A property as a BIGINT when it is 1..``digits`` decimal digits, else NULL."""
    raw = props.getItem(key)
    # A regex guard instead of a cast that raises under ANSI mode on a malformed value.
    return F.when(raw.rlike(f"^[0-9]{{1,{digits}}}$"), raw.cast("bigint"))


def promoted_copy(batch_id: Column) -> Column:
    """Whether a commit_log row is a copy promote wrote (its batch kind is a delay level or
    the timer kind, ``ids``): its store time is when it may be handed out, which its index
    row carries as ``due_ts`` so that no reader hands it out earlier (:func:`not_due`)."""
    kind = batch_id.bitwiseAND(F.lit(ids.PRODUCER_BIT - 1))
    return (batch_id.bitwiseAND(F.lit(ids.PRODUCER_BIT)) == F.lit(0)) & kind.between(1, ids.KIND_TIMER)


def _routed(rows: DataFrame, levels: list[tuple[int, int]]) -> DataFrame:
    """New commit_log rows with their ``route`` (plain / schedule / timer / half), the
    index queue they go to (``q_topic``, ``q_id``) and their due time (``due``): for a copy
    promote wrote, its store time, which promote set to when it may be handed out
    (``promote.store_at``)."""
    max_level = max((lvl for lvl, _ in levels), default=0)
    delay_of = F.create_map(*[x for lvl, ms in levels for x in (F.lit(lvl), F.lit(ms).cast("bigint"))])
    props = F.col("properties")
    # A discarded half message (TRANS_CHECK_MAX_TIME_TOPIC) keeps its prepared flag but
    # is an ordinary message of that topic.
    is_half = (
        (props.getItem(Prop.TRAN_MSG) == F.lit("true"))
        & (F.col("sys_flag").bitwiseAND(F.lit(0xC)) == F.lit(SysFlag.TRANSACTION_PREPARED_TYPE))
        & (F.col("topic") != F.lit(TRANS_CHECK_MAX_TIME_TOPIC))
    )
    timer_ms = int_prop(props, Prop.TIMER_DELIVER_MS, 18)
    raw_level = int_prop(props, Prop.DELAY, 9)
    # least() skips NULLs, so guard it: no DELAY property means no level.
    level = F.when(raw_level.isNotNull(), F.least(raw_level, F.lit(max_level)))
    route = (
        F.when(is_half, "half")
        .when(timer_ms.isNotNull(), "timer")
        .when((level > 0) & F.lit(max_level > 0), "schedule")
        .otherwise("plain")
    )
    routed = rows.withColumn("route", route).withColumn("level", level)
    on = F.col("route")
    topic = (
        F.when(on == "half", F.lit(TRANS_HALF_TOPIC))
        .when(on == "timer", F.lit(TIMER_TOPIC))
        .when(on == "schedule", F.lit(SCHEDULE_TOPIC))
        .otherwise(F.col("topic"))
    )
    qid = (
        F.when(on == "schedule", (F.col("level") - 1).cast("int"))
        .when(on.isin("half", "timer"), F.lit(0))
        .otherwise(F.col("queue_id"))
    )
    due = (
        F.when(on == "timer", timer_ms)
        .when(on == "schedule", F.col("store_ts") + F.element_at(delay_of, F.col("level").cast("int")))
        .when((on == "plain") & promoted_copy(F.col("batch_id")), F.col("store_ts"))
        .cast("bigint")
    )
    return routed.withColumn("q_topic", topic).withColumn("q_id", qid).withColumn("due", due)


def plan_index(rows: DataFrame, heads: DataFrame, levels: list[tuple[int, int]]) -> DataFrame:
    """Pure plan: new commit_log rows (+ ``cl_version``) and queue heads → consume_queue rows
    with a ``route`` column (plain / schedule / timer / half)."""
    props = F.col("properties")
    on = F.col("route")
    clean = F.map_filter(
        F.coalesce(props, F.create_map().cast("map<string,string>")),
        lambda k, v: ~k.isin(Prop.REAL_TOPIC, Prop.REAL_QID),
    )
    real = F.create_map(
        F.lit(Prop.REAL_TOPIC), F.col("topic"), F.lit(Prop.REAL_QID), F.col("queue_id").cast("string")
    )
    indexed = _routed(rows, levels).select(
        "q_topic",
        "q_id",
        "msg_id",
        "tags",
        F.when(F.col("tags").isNotNull(), F.xxhash64("tags")).alias("tags_hash"),
        "keys",
        F.when(on == "plain", props).otherwise(F.map_concat(clean, real)).alias("properties"),
        "store_ts",
        F.col("due").alias("due_ts"),
        "reconsume_times",
        ids.store_date_col(F.col("store_ts")).alias("cl_date"),
        "cl_version",
        F.col("batch_id").alias("cl_batch_id"),
        F.col("batch_pos").alias("cl_batch_pos"),
        "route",
        F.when(on == "schedule", F.col("q_id"))
        .when(on == "timer", F.floor(F.col("due") / F.lit(TIMER_SLOT_MS)))
        .otherwise(F.lit(0))
        .cast("int")
        .alias("slot"),
        "born_ts",
    )
    order = Window.partitionBy("q_topic", "q_id").orderBy("cl_version", "cl_batch_id", "cl_batch_pos")
    h = heads.select(F.col("topic").alias("h_topic"), F.col("queue_id").alias("h_qid"), "next_offset")
    joined = indexed.join(
        F.broadcast(h), (F.col("q_topic") == F.col("h_topic")) & (F.col("q_id") == F.col("h_qid")), "left"
    )
    with_offset = joined.withColumn(
        "queue_offset",
        (F.coalesce(F.col("next_offset"), F.lit(0)) + F.row_number().over(order) - 1).cast("bigint"),
    )
    return with_offset.select(
        F.col("q_topic").alias("topic"),
        F.col("q_id").alias("queue_id"),
        *[c for c in TABLES["consume_queue"].columns if c not in ("topic", "queue_id")],
        "route",
    )


def heads_frame(wh: Warehouse, heads: Mapping[Queue, int]) -> DataFrame:
    """Queue heads (next offset per (topic, queue)) as the frame :func:`plan_index` takes."""
    return wh.engine.spark.createDataFrame([(t, q, o) for (t, q), o in sorted(heads.items())], _HEADS_SCHEMA)


def merge_index(wh: Warehouse, plan: DataFrame, first_version: int, last_version: int) -> None:
    """The index commit: the rows of ``plan`` (a :func:`plan_index` plan of the commits
    ``first_version..last_version``) into ``consume_queue``. Insert-only MERGE keyed on
    msg_id within this version range: an indexer that raced us (a lease violation)
    conflicts or finds the rows present. The caller commits (``Context.commit``)."""
    cols = ", ".join(TABLES["consume_queue"].columns)
    with wh.engine.views() as views:
        source = views.add(plan, "index_src")
        wh.engine.execute(
            f"MERGE INTO {wh.ref('consume_queue')} t USING (SELECT {cols} FROM {source}) s "
            f"ON t.cl_version >= {sql_long(first_version)} "
            f"AND t.cl_version <= {sql_long(last_version)} "
            "AND t.msg_id = s.msg_id WHEN NOT MATCHED THEN INSERT *"
        )


def _indexed_in(wh: Warehouse, first: int, last: int) -> list[tuple[Queue, int, int]]:
    """(queue, rows, highest offset) of the rows indexed from versions ``first..last``,
    read back from the index (a few columns of the new files) rather than by evaluating
    the plan a second time."""
    return [
        ((r["topic"], r["queue_id"]), r["n"], r["hi"])
        for r in wh.engine.rows(
            f"SELECT topic, queue_id, count(*) AS n, max(queue_offset) AS hi "
            f"FROM {wh.ref('consume_queue')} WHERE cl_version >= {sql_long(first)} "
            f"AND cl_version <= {sql_long(last)} GROUP BY topic, queue_id"
        )
    ]


def index_new(
    wh: Warehouse,
    max_versions: int,
    *,
    fence: Callable[[], None] | None = None,
    job: str = "dispatch",
) -> Indexed:
    """Index every commit_log commit after the index's version (at most ``max_versions``
    of them). ``fence`` is called before the index commit (lease check); ``job`` names the
    caller's fault points (``<job>.before_index_commit`` / ``.after_index_commit``). The
    caller commits (``Context.commit``: a conflict re-runs the whole pass). A pass of up
    to ``index_files.MAX_ROWS`` rows (``MAX_ORDERED_ROWS`` of files ordered by queue) is
    planned and appended from the tables' files (deltamq/tables/index_files.py), a
    larger one through the engine."""
    fs, state = _indexing_state(wh)
    commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), state.version, max_versions)
    if not commits:
        # Nothing new; but a pass killed after its index commit left the hint behind the
        # index: report the corrected heads so the hint is brought up to date.
        return Indexed(
            from_version=state.version,
            to_version=state.version,
            commits_read=0,
            rows_in=0,
            rows_out=0,
            routes={},
            queues=dict(state.stale),
            heads=dict(state.heads),
        )
    if fs is not None and index_files.fits(commits):
        rows, repeated = index_files.drop_repeated(fs, index_files.added(wh, fs, commits), commits)
        index = index_files.plan(rows, state.heads, wh.levels())
        faults.point(f"{job}.before_index_commit")
        if index.num_rows:
            if fence:
                fence()
            index_files.append(wh, fs, index)
        indexed, dropped = index_files.tally(index), 0
    else:
        indexed, dropped, repeated = _index_by_engine(wh, commits, state, fence, job)
    faults.point(f"{job}.after_index_commit")
    # heads an earlier pass indexed but its hint never recorded (killed between its
    # index and progress commits): the hint written next moves its version past them,
    # so they must go with it
    queues: dict[Queue, int] = dict(state.stale)
    routes: dict[str, int] = {}
    n = 0
    for queue, count, hi in indexed:
        route = _ROUTE_OF_TOPIC.get(queue[0], "plain")
        routes[route] = routes.get(route, 0) + count
        queues[queue] = max(queues.get(queue, 0), hi + 1)
        n += count
    return Indexed(
        from_version=state.version,
        to_version=commits[-1].version,
        commits_read=len(commits),
        rows_in=n + dropped + repeated,
        rows_out=n,
        routes=routes,
        queues=queues,
        duplicate_commits=dropped,
        repeated=repeated,
        heads=state.heads | queues,
    )


def _indexing_state(wh: Warehouse) -> tuple[index_files.FilesState | None, DispatchState]:
    """Where the index stands, read from the tables' files when a pass can be planned and
    appended there (with the version it is appended after), else through the engine."""
    fs = index_files.state(wh)
    return fs, DispatchState(fs.version, fs.heads, fs.stale) if fs else load_dispatch_state(wh)


def _index_by_engine(
    wh: Warehouse,
    commits: list[deltalog.Commit],
    state: DispatchState,
    fence: Callable[[], None] | None,
    job: str,
) -> tuple[list[tuple[Queue, int, int]], int, int]:
    """:func:`index_new`'s pass through the engine: the rows indexed (queue, rows, highest
    offset), the committed messages dropped as duplicates and the repeated rows dropped."""
    rows = commit_log.read_added(wh, commits)
    dropped = repeated = 0
    if rows is not None:
        rows, repeated = drop_repeated(wh, rows, commits)
    if rows is not None and commit_log.may_hold_commits(commits):
        rows, dropped = drop_duplicate_commits(wh, rows)
    plan = None if rows is None else plan_index(rows, heads_frame(wh, state.heads), wh.levels())
    faults.point(f"{job}.before_index_commit")
    if plan is None:
        return [], dropped, repeated
    if fence:
        fence()
    merge_index(wh, plan, commits[0].version, commits[-1].version)
    return _indexed_in(wh, commits[0].version, commits[-1].version), dropped, repeated


def index_appended(
    wh: Warehouse,
    levels: list[tuple[int, int]],
    rows: int,
    by_queue: Mapping[Queue, int],
    *,
    job: str,
) -> Indexed | None:
    """Index the ``rows`` plain messages a caller has just appended in one commit (their
    count per real queue: ``by_queue``), when that commit is the only one the index lacks:
    the rows are then exactly those :func:`index_new` would write (the same plan over the
    same commit after the same heads), and each carries the commit's version
    (``cl_version``), so :func:`index_new` counts them as indexed and never indexes them
    again. Otherwise (another commit came between, a rewrite, committed transactional
    messages to de-duplicate, messages already indexed) nothing is done (None) and the
    next :func:`index_new` indexes them.

    The messages must take the plain route (no DELAY, timer or half properties), so the
    heads of their queues move by ``by_queue``. The result's ``queues`` is the hint the
    caller writes with its progress (``offsets.advance_offsets``, ``%DISPATCH%`` rows):
    the version reached and those heads, with the ones the old hint lacked. The caller
    commits (``Context.commit``); dispatch's state is read inside, so a retry after a
    conflict starts from the index as it then is. Planned and appended from the files
    when they allow it (deltamq/tables/index_files.py), else through the engine.
    """
    fs, state = _indexing_state(wh)
    commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), state.version, 2)
    if (
        len(commits) != 1
        or not commit_log.only_appended(commits[0], rows)
        or commit_log.may_hold_commits(commits)
    ):
        return None
    version = commits[0].version
    # a commit holding messages already indexed (a copy written again by a pass that ran
    # after a killed one) is left to index_new, which drops them: every message keeps one
    # index entry
    if fs is not None and index_files.fits(commits):
        new_rows = index_files.added(wh, fs, commits)
        if index_files.drop_repeated(fs, new_rows, commits)[1]:
            return None
        index_files.append(wh, fs, index_files.plan(new_rows, state.heads, levels))
    else:
        added = commit_log.read_added(wh, commits)
        if added is None or drop_repeated(wh, added, commits)[1]:
            return None
        merge_index(wh, plan_index(added, heads_frame(wh, state.heads), levels), version, version)
    faults.point(f"{job}.after_index_commit")
    queues = dict(state.stale) | {q: state.heads.get(q, 0) + n for q, n in by_queue.items()}
    return Indexed(
        from_version=state.version,
        to_version=version,
        commits_read=1,
        rows_in=rows,
        rows_out=rows,
        routes={"plain": rows},
        queues=queues,
        heads=state.heads | queues,
    )


# --- reads ---------------------------------------------------------------------------------
class QueueExtent(NamedTuple):
    """A queue's lowest and next offset, and the lowest offset that must stay."""

    topic: str
    queue_id: int
    low: int
    head: int
    keep: int | None


@dataclass(frozen=True)
class HeldState:
    """Where the holders of the system queues stand: each delay level's next offset
    (by schedule queue id), the timer watermark and timer offset seen, and check-back's
    half and op offsets. What retention must keep and what is pending follow from it."""

    level_offsets: Mapping[int, int]
    timer_watermark: int
    timer_next_offset: int
    half_offset: int
    op_offset: int


def extents(wh: Warehouse, cut: int, dlq_cut: int, held: HeldState) -> list[QueueExtent]:
    """Every queue but the timer index: its extent and the lowest offset retention keeps
    (a row stored at or after ``cut`` — ``dlq_cut`` in a dead-letter topic — or not yet
    handled by its holder)."""
    promoted_to = " ".join(f"WHEN {q} THEN {sql_long(o)}" for q, o in sorted(held.level_offsets.items()))
    level_offset = f"CASE queue_id {promoted_to} ELSE 0 END" if promoted_to else "0"
    # a dead-letter topic by its prefix compared as text (in LIKE its % signs are wildcards)
    dead = f"substring(topic, 1, {len(DLQ_PREFIX)}) = {sql_str(DLQ_PREFIX)}"
    stays = (
        f"(store_ts >= {sql_long(cut)} "
        f"OR ({dead} AND store_ts >= {sql_long(dlq_cut)}) "
        f"OR (topic = {sql_str(SCHEDULE_TOPIC)} AND queue_offset >= {level_offset}) "
        f"OR (topic = {sql_str(TRANS_HALF_TOPIC)} AND queue_offset >= {sql_long(held.half_offset)}) "
        f"OR (topic = {sql_str(TRANS_OP_HALF_TOPIC)} AND queue_offset >= {sql_long(held.op_offset)}))"
    )
    return [
        QueueExtent(r["topic"], r["queue_id"], r["lo"], r["head"], r["keep"])
        for r in wh.engine.rows(
            f"SELECT topic, queue_id, min(queue_offset) AS lo, max(queue_offset) + 1 AS head, "
            f"min(CASE WHEN {stays} THEN queue_offset END) AS keep FROM {wh.ref('consume_queue')} "
            f"WHERE topic <> {sql_str(TIMER_TOPIC)} GROUP BY topic, queue_id"
        )
    ]


def minimums(wh: Warehouse, topic: str | None = None, *, stored_from: int | None = None) -> dict[Queue, int]:
    """The lowest offset of each queue (of ``topic``; among rows stored at or after
    ``stored_from``)."""
    where = []
    if topic is not None:
        where.append(f"topic = {sql_str(topic)}")
    if stored_from is not None:
        where.append(f"store_ts >= {sql_long(stored_from)}")
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    return {
        (r["topic"], r["queue_id"]): r["lo"]
        for r in wh.engine.rows(
            f"SELECT topic, queue_id, min(queue_offset) AS lo FROM {wh.ref('consume_queue')}{clause} "
            "GROUP BY topic, queue_id"
        )
    }


def count(wh: Warehouse) -> int:
    """Rows in the index."""
    return int(wh.engine.rows(f"SELECT count(*) AS n FROM {wh.ref('consume_queue')}")[0]["n"])


def _expired_timers(cut: int, held: HeldState) -> str:
    return (
        f"topic = {sql_str(TIMER_TOPIC)} AND store_ts < {sql_long(cut)} "
        f"AND due_ts <= {sql_long(held.timer_watermark)} "
        f"AND queue_offset < {sql_long(held.timer_next_offset)}"
    )


def expired_timers(wh: Warehouse, cut: int, held: HeldState) -> int:
    """Timer index rows stored before ``cut`` that promote has handled."""
    return int(
        wh.engine.rows(
            f"SELECT count(*) AS n FROM {wh.ref('consume_queue')} WHERE {_expired_timers(cut, held)}"
        )[0]["n"]
    )


def batches_before(wh: Warehouse, day: date) -> dict[date, set[int]]:
    """The commit_log batches that index rows of days before ``day`` point at, by day."""
    out: dict[date, set[int]] = {}
    for r in wh.engine.rows(
        f"SELECT DISTINCT cl_date, cl_batch_id FROM {wh.ref('consume_queue')} "
        f"WHERE cl_date < DATE'{day.isoformat()}'"
    ):
        out.setdefault(r["cl_date"], set()).add(r["cl_batch_id"])
    return out


def arrivals(
    wh: Warehouse, topics: list[str], start: int, lo: int, hi: int, width: int
) -> dict[str, dict[int, int]]:
    """Messages indexed per topic and bucket ``k`` of ``width`` ms from ``start``, stored in
    ``[lo, hi)``: one aggregate pruned by the topics' partitions and ``cl_batch_id``."""
    out: dict[str, dict[int, int]] = {}
    for r in wh.engine.rows(
        f"SELECT topic, CAST(floor((store_ts - {sql_long(start)}) / {width}) AS BIGINT) AS k, count(*) AS n "
        f"FROM {wh.ref('consume_queue')} WHERE topic IN {sql_in(topics)} "
        f"AND cl_batch_id >= {sql_long(start << ids.BATCH_RANDOM_BITS)} "
        f"AND store_ts >= {sql_long(lo)} AND store_ts < {sql_long(hi)} GROUP BY topic, k"
    ):
        out.setdefault(r["topic"], {})[r["k"]] = r["n"]
    return out


def held_levels(
    wh: Warehouse, level_offsets: Mapping[int, int], levels: list[tuple[int, int]]
) -> dict[int, tuple[int, int]]:
    """Per schedule queue id with entries at or after its level's offset: (entries,
    oldest due time)."""
    held = _in_levels(level_offsets, levels)
    return {
        r["queue_id"]: (r["n"], r["oldest_due"])
        for r in wh.engine.rows(
            f"SELECT queue_id, count(*) AS n, min(due_ts) AS oldest_due FROM {wh.ref('consume_queue')} "
            f"WHERE topic = {sql_str(SCHEDULE_TOPIC)} AND ({held}) GROUP BY queue_id"
        )
    }


def held_for(
    wh: Warehouse,
    level_offsets: Mapping[int, int],
    levels: list[tuple[int, int]],
    timers: tuple[int, int],
    topic: str,
) -> int:
    """How many entries still held (in a delay level, or as a timer: ``timers`` is the
    timer watermark and next offset) are for ``topic`` (a group's retry topic: its retries
    waiting, by level or by a retry policy's timer)."""
    n: int = wh.engine.rows(
        f"SELECT count(*) AS n FROM {wh.ref('consume_queue')} "
        f"WHERE properties[{sql_str(Prop.REAL_TOPIC)}] = {sql_str(topic)} AND ("
        f"(topic = {sql_str(SCHEDULE_TOPIC)} AND ({_in_levels(level_offsets, levels)})) OR "
        f"(topic = {sql_str(TIMER_TOPIC)} AND {_timer_held(*timers)}))"
    )[0]["n"]
    return n


def _in_levels(level_offsets: Mapping[int, int], levels: list[tuple[int, int]]) -> str:
    """Schedule entries at or after their level's saved offset: not promoted yet."""
    held = " OR ".join(
        f"(slot = {lvl - 1} AND queue_offset >= {sql_long(level_offsets.get(lvl - 1, 0))})"
        for lvl, _ in levels
    )
    return held or "FALSE"


def _timer_held(watermark: int, next_offset: int) -> str:
    """Timer entries not promoted yet: due after the watermark, or not read up to."""
    return f"(due_ts > {sql_long(watermark)} OR queue_offset >= {sql_long(next_offset)})"


def held_timers(wh: Warehouse, watermark: int, next_offset: int) -> list[tuple[date, int, int]]:
    """Timers not yet promoted, by due day: (day, entries, first due time)."""
    return [
        (r["due_day"], r["n"], r["first_due"])
        for r in wh.engine.rows(
            f"SELECT date_from_unix_date(CAST(floor(due_ts / {ids.DAY_MS}) AS INT)) AS due_day, "
            f"count(*) AS n, min(due_ts) AS first_due FROM {wh.ref('consume_queue')} "
            f"WHERE topic = {sql_str(TIMER_TOPIC)} AND {_timer_held(watermark, next_offset)} "
            "GROUP BY 1 ORDER BY 1"
        )
    ]


def earliest_due_query(
    wh: Warehouse, level_heads: Mapping[int, int], watermark: int, after: int
) -> list[str]:
    """Queries (one column ``d``) for a wake-up: the earliest timer due after
    ``watermark``, and the earliest due time after ``after`` among the level heads
    (schedule queue id → its next offset)."""
    cq = wh.ref("consume_queue")
    parts = [
        f"SELECT min(due_ts) AS d FROM {cq} WHERE topic = {sql_str(TIMER_TOPIC)} "
        f"AND slot >= {watermark // TIMER_SLOT_MS} AND due_ts > {sql_long(watermark)}"
    ]
    heads = " OR ".join(
        f"(slot = {q} AND queue_offset = {sql_long(o)})" for q, o in sorted(level_heads.items())
    )
    if heads:
        parts.append(
            f"SELECT min(due_ts) AS d FROM {cq} WHERE topic = {sql_str(SCHEDULE_TOPIC)} AND ({heads}) "
            f"AND due_ts > {sql_long(after)}"
        )
    return parts


# --- removal (retention, rebuild) ------------------------------------------------------------
def trim(wh: Warehouse, keep_from: Mapping[Queue, int]) -> None:
    """Delete each queue's rows below its ``keep_from`` offset (one MERGE; the caller
    commits)."""
    values = ", ".join(f"({sql_str(t)}, {q}, {sql_long(m)})" for (t, q), m in sorted(keep_from.items()))
    wh.engine.execute(
        f"MERGE INTO {wh.ref('consume_queue')} t "
        f"USING (SELECT * FROM VALUES {values} AS v(topic, queue_id, keep_from)) s "
        "ON t.topic = s.topic AND t.queue_id = s.queue_id AND t.queue_offset < s.keep_from "
        "WHEN MATCHED THEN DELETE"
    )


def delete_expired_timers(wh: Warehouse, cut: int, held: HeldState) -> None:
    """Delete the rows :func:`expired_timers` counts (the caller commits)."""
    wh.engine.execute(f"DELETE FROM {wh.ref('consume_queue')} WHERE {_expired_timers(cut, held)}")


def wipe(wh: Warehouse) -> None:
    """Delete every row (``rebuild-index``; the caller commits)."""
    wh.engine.execute(f"DELETE FROM {wh.ref('consume_queue')}")
