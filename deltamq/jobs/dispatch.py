"""Dispatch: RocketMQ's reput service on Delta — new ``commit_log`` rows → ``consume_queue``.

How new rows are found (docs/design.md, "How dispatch finds new rows"): dispatch remembers
the last ``commit_log`` version it indexed and reads only the files that later
*blind-append* commits added (from the Delta commit entries), so its cost follows new
data and no row is missed whatever a producer's commit latency or clock. Rows are
ordered by (commit version, producer batch, position); offsets are dense per queue and
a deterministic function of that order.

Exactly once: the version each row came from is written in the ``consume_queue`` row
itself (``cl_version``), so the index and its progress commit atomically. The
``%DISPATCH%`` rows of ``offsets`` (per-queue next offset, and the version reached)
are a hint written afterwards: on start, dispatch reads the hint and then the
``consume_queue`` rows newer than it (a range that file statistics prune), so a
kill between the two commits loses and repeats nothing.

Routing (docs/behaviour.md §2, §5): transactional half messages → ``RMQ_SYS_TRANS_HALF_TOPIC``
queue 0; messages with ``TIMER_DELIVER_MS`` → the timer index (``rmq_sys_wheel_timer``)
with their due time; ``DELAY`` > 0 → ``SCHEDULE_TOPIC_XXXX`` queue ``level - 1``
(level clamped to the maximum), due at ``store_ts + delay(level)``. Routed rows keep
their real topic and queue in ``REAL_TOPIC`` / ``REAL_QID``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from deltamq import faults, ids
from deltamq.constants import (
    DISPATCH_GROUP,
    DLQ_PREFIX,
    RETRY_PREFIX,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Prop,
    SysFlag,
)
from deltamq.schemas import SCHEMA_VERSION, TABLES
from deltamq.tables import deltalog
from deltamq.tables.integrity import check_added
from deltamq.tables.offsets import advance_offsets, load_dispatch_state
from deltamq.tables.sqltext import sql_long

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.tables.warehouse import Warehouse

JOB = "dispatch"
TIMER_SLOT_MS = 3_600_000  # the timer index is partitioned by due hour
ROUTES = ("plain", "schedule", "timer", "half")
_HEADS_SCHEMA = "topic string, queue_id int, next_offset bigint"
# the route of an index row, by the topic it was indexed under (plan_dispatch's routes)
_ROUTE_OF_TOPIC = {TRANS_HALF_TOPIC: "half", TIMER_TOPIC: "timer", SCHEDULE_TOPIC: "schedule"}
# commit_log columns stored inside the Parquet files (partition columns are not).
_FILE_SCHEMA = T.StructType(
    [f for f in TABLES["commit_log"].columns_at(SCHEMA_VERSION).fields if f.name != "store_date"]
)


@dataclass(frozen=True, kw_only=True)
class DispatchResult:
    from_version: int
    to_version: int
    commits_read: int
    rows_in: int
    rows_out: int
    routes: dict[str, int]
    queues: dict[tuple[str, int], int]
    duplicate_commits: int = 0  # committed messages of already committed transactions, not indexed
    heads: dict[tuple[str, int], int] = field(default_factory=dict)  # every queue's next offset after

    @property
    def details(self) -> dict[str, int]:
        out = {f"route_{k}": v for k, v in self.routes.items()} | {"commits_read": self.commits_read}
        return out | ({"duplicate_commits": self.duplicate_commits} if self.duplicate_commits else {})


# --- reading ------------------------------------------------------------------------------
def read_new_rows(wh: Warehouse, commits: list[deltalog.Commit]) -> DataFrame | None:
    """commit_log rows added by ``commits`` with their ``cl_version``.

    Files are read in one scan and mapped to their version through the ``batch_id``
    statistics of each added file (one batch per producer commit). Files whose
    statistics cannot say (missing stats, a batch id seen in two versions) are read
    per version instead. A file that is missing or truncated stops dispatch before it
    reads (TableDamaged): Sail skips a missing path in a file list silently.
    """
    spark = wh.engine.spark
    check_added(wh.storage, "commit_log", [f for c in commits for f in c.files])
    by_batch: dict[int, set[int]] = defaultdict(set)
    stat_files: list[tuple[int, deltalog.AddedFile, int]] = []
    odd: dict[int, list[str]] = defaultdict(list)
    for c in commits:
        for f in c.files:
            lo, hi = f.min_values.get("batch_id"), f.max_values.get("batch_id")
            if lo is not None and lo == hi:
                stat_files.append((c.version, f, lo))
                by_batch[lo].add(c.version)
            else:
                odd[c.version].append(wh.engine_path(f.path))
    mapped: list[tuple[int, int]] = []
    mapped_paths: list[str] = []
    for version, f, batch in stat_files:
        if len(by_batch[batch]) > 1:
            odd[version].append(wh.engine_path(f.path))
        else:
            mapped.append((batch, version))
            mapped_paths.append(wh.engine_path(f.path))
    parts: list[DataFrame] = []
    if mapped_paths:
        versions = spark.createDataFrame(sorted(set(mapped)), "batch_id bigint, cl_version bigint")
        data = spark.read.schema(_FILE_SCHEMA).parquet(*mapped_paths)
        parts.append(data.join(F.broadcast(versions), "batch_id"))
    for version, paths in sorted(odd.items()):
        parts.append(
            spark.read.schema(_FILE_SCHEMA)
            .parquet(*paths)
            .withColumn("cl_version", F.lit(version).cast("bigint"))
        )
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def may_hold_commits(commits: list[deltalog.Commit]) -> bool:
    """Whether the commits' files may hold committed transactional messages (``sys_flag``
    statistics ≥ the commit type; a file without statistics may)."""
    return any(
        (f.max_values.get("sys_flag") is None or f.max_values["sys_flag"] >= SysFlag.TRANSACTION_COMMIT_TYPE)
        for c in commits
        for f in c.files
    )


def _tran_time_col(tran_id: Column) -> Column:
    """Store time (epoch ms) encoded in a transaction id (the first half's msg id)."""
    return F.shiftright(F.conv(F.substring(tran_id, 1, 16), 16, 10).cast("bigint"), ids.BATCH_RANDOM_BITS)


def drop_duplicate_commits(wh: Warehouse, rows: DataFrame) -> tuple[DataFrame, int]:
    """New rows without the committed messages of transactions already committed.

    A transaction may be committed twice: by its producer and by a check pass that ran
    before the producer's end landed (RocketMQ delivers both). Each COMMIT stores the
    real message and its op record in one commit, so a committed message is dropped when
    an op record of its ``TRAN_ID`` is already indexed or an earlier committed message of
    it is among the new rows. Op records are looked up from the oldest new transaction's
    start on (their batch ids grow with time), so the read follows recent history.
    Returns the rows to index and how many were dropped (they stay in commit_log).
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
    commits = rows.where(is_commit).select(
        "msg_id", "cl_version", "batch_id", "batch_pos", props.getItem(Prop.TRAN_ID).alias("tran")
    )
    oldest = commits.agg(F.min(_tran_time_col(F.col("tran"))).alias("t0")).collect()[0]["t0"]
    if oldest is None:
        return rows, 0
    settled = (
        wh.read("consume_queue")
        .where(
            (F.col("topic") == F.lit(TRANS_OP_HALF_TOPIC))
            & (F.col("slot") == F.lit(0))
            & (F.col("cl_batch_id") >= F.lit(oldest << ids.BATCH_RANDOM_BITS))
        )
        .select(F.col("properties").getItem(Prop.TRAN_ID).alias("done_tran"))
        .distinct()
    )
    order = Window.partitionBy("tran").orderBy("cl_version", "batch_id", "batch_pos")
    ranked = commits.withColumn("rn", F.row_number().over(order)).join(
        F.broadcast(settled), F.col("tran") == F.col("done_tran"), "left"
    )
    dups = ranked.where((F.col("rn") > 1) | F.col("done_tran").isNotNull()).select(
        F.col("msg_id").alias("dup_id")
    )
    dropped = dups.count()
    if not dropped:
        return rows, 0
    return rows.join(F.broadcast(dups), F.col("msg_id") == F.col("dup_id"), "left_anti"), dropped


# --- planning (pure) ----------------------------------------------------------------------
def int_prop(props: Column, key: str, digits: int) -> Column:
    """A property as a BIGINT when it is 1..``digits`` decimal digits, else NULL."""
    raw = props.getItem(key)
    # A regex guard instead of a cast that raises under ANSI mode on a malformed value.
    return F.when(raw.rlike(f"^[0-9]{{1,{digits}}}$"), raw.cast("bigint"))


def plan_dispatch(rows: DataFrame, heads: DataFrame, levels: list[tuple[int, int]]) -> DataFrame:
    """Pure plan: new commit_log rows (+ ``cl_version``) and queue heads → consume_queue rows
    with a ``route`` column (plain / schedule / timer / half)."""
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
    topic = (
        F.when(F.col("route") == "half", F.lit(TRANS_HALF_TOPIC))
        .when(F.col("route") == "timer", F.lit(TIMER_TOPIC))
        .when(F.col("route") == "schedule", F.lit(SCHEDULE_TOPIC))
        .otherwise(F.col("topic"))
    )
    qid = (
        F.when(F.col("route") == "schedule", (F.col("level") - 1).cast("int"))
        .when(F.col("route").isin("half", "timer"), F.lit(0))
        .otherwise(F.col("queue_id"))
    )
    due = (
        F.when(F.col("route") == "timer", timer_ms)
        .when(
            F.col("route") == "schedule",
            F.col("store_ts") + F.element_at(delay_of, F.col("level").cast("int")),
        )
        .cast("bigint")
    )
    clean = F.map_filter(
        F.coalesce(props, F.create_map().cast("map<string,string>")),
        lambda k, v: ~k.isin(Prop.REAL_TOPIC, Prop.REAL_QID),
    )
    real = F.create_map(
        F.lit(Prop.REAL_TOPIC), F.col("topic"), F.lit(Prop.REAL_QID), F.col("queue_id").cast("string")
    )
    new_props = F.when(F.col("route") == "plain", props).otherwise(F.map_concat(clean, real))
    indexed = routed.select(
        topic.alias("q_topic"),
        qid.alias("q_id"),
        "msg_id",
        "tags",
        F.when(F.col("tags").isNotNull(), F.xxhash64("tags")).alias("tags_hash"),
        "keys",
        new_props.alias("properties"),
        "store_ts",
        due.alias("due_ts"),
        "reconsume_times",
        ids.store_date_col(F.col("store_ts")).alias("cl_date"),
        "cl_version",
        F.col("batch_id").alias("cl_batch_id"),
        F.col("batch_pos").alias("cl_batch_pos"),
        "route",
        F.when(F.col("route") == "schedule", qid)
        .when(F.col("route") == "timer", F.floor(due / F.lit(TIMER_SLOT_MS)))
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


# --- running ------------------------------------------------------------------------------
def heads_frame(wh: Warehouse, heads: dict[tuple[str, int], int]) -> DataFrame:
    """Queue heads (next offset per (topic, queue)) as the frame :func:`plan_dispatch` takes."""
    return wh.engine.spark.createDataFrame([(t, q, o) for (t, q), o in sorted(heads.items())], _HEADS_SCHEMA)


def merge_index(wh: Warehouse, plan: DataFrame, first_version: int, last_version: int) -> None:
    """The index commit: the rows of ``plan`` (a :func:`plan_dispatch` plan of the commits
    ``first_version..last_version``) into ``consume_queue``. Insert-only MERGE keyed on
    msg_id within this version range: a dispatcher that raced us (a lease violation)
    conflicts or finds the rows present. The caller commits (``engine.commit``)."""
    cols = ", ".join(TABLES["consume_queue"].columns)
    with wh.engine.views() as views:
        source = views.add(plan, "index_src")
        wh.engine.execute(
            f"MERGE INTO {wh.ref('consume_queue')} t USING (SELECT {cols} FROM {source}) s "
            f"ON t.cl_version >= {sql_long(first_version)} "
            f"AND t.cl_version <= {sql_long(last_version)} "
            "AND t.msg_id = s.msg_id WHEN NOT MATCHED THEN INSERT *"
        )


def run(ctx: Context, now: int, *, fence: Callable[[], None] | None = None) -> DispatchResult:
    """Index every commit_log row committed since the last run.

    Due times come from store times, so ``now`` only stamps the progress rows.
    ``fence`` is called before the index commit (lease check).
    """
    wh, engine = ctx.warehouse, ctx.engine
    max_versions = ctx.config.dispatch_max_versions

    def index() -> DispatchResult:
        state = load_dispatch_state(wh)
        commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), state.version, max_versions)
        if not commits:
            # Nothing new; but a run killed after its index commit left the hint behind
            # the index: report the corrected heads so the hint is brought up to date.
            return DispatchResult(
                from_version=state.version,
                to_version=state.version,
                commits_read=0,
                rows_in=0,
                rows_out=0,
                routes={},
                queues=dict(state.stale),
                heads=dict(state.heads),
            )
        to_version = commits[-1].version
        rows = read_new_rows(wh, commits)
        routes: dict[str, int] = {}
        # heads an earlier pass indexed but its hint never recorded (killed between its
        # index and progress commits): the hint written below moves its version past them,
        # so they must go with it
        queues: dict[tuple[str, int], int] = dict(state.stale)
        n = dropped = 0
        if rows is not None and may_hold_commits(commits):
            rows, dropped = drop_duplicate_commits(wh, rows)
        plan = None if rows is None else plan_dispatch(rows, heads_frame(wh, state.heads), wh.levels())
        faults.point("dispatch.before_index_commit")
        if plan is not None:
            if fence:
                fence()
            merge_index(wh, plan, commits[0].version, to_version)
            # What was indexed, read back from the index (a few columns of the new files)
            # rather than by evaluating the plan a second time.
            for r in engine.rows(
                f"SELECT topic, queue_id, count(*) AS n, max(queue_offset) AS hi "
                f"FROM {wh.ref('consume_queue')} WHERE cl_version >= {sql_long(commits[0].version)} "
                f"AND cl_version <= {sql_long(to_version)} GROUP BY topic, queue_id"
            ):
                route = _ROUTE_OF_TOPIC.get(r["topic"], "plain")
                routes[route] = routes.get(route, 0) + r["n"]
                key = (r["topic"], r["queue_id"])
                queues[key] = max(queues.get(key, 0), r["hi"] + 1)
                n += r["n"]
        faults.point("dispatch.after_index_commit")
        return DispatchResult(
            from_version=state.version,
            to_version=to_version,
            commits_read=len(commits),
            rows_in=n + dropped,
            rows_out=n,
            routes=routes,
            queues=queues,
            duplicate_commits=dropped,
            heads=state.heads | queues,
        )

    result = ctx.commit(index, what=JOB)
    if result.commits_read or result.queues:
        ctx.commit(lambda: write_progress(wh, result.to_version, result.queues, now), what="offsets")
        faults.point("dispatch.after_progress_commit")
    return result


def write_progress(wh: Warehouse, version: int, queues: dict[tuple[str, int], int], now: int) -> None:
    """Record the hint: version reached and per-queue next offsets (%DISPATCH% rows)."""
    rows = [("", -1, None, version)] + [(t, q, o, None) for (t, q), o in sorted(queues.items())]
    advance_offsets(wh, DISPATCH_GROUP, rows, now)
