"""check_transactions: RocketMQ's TransactionalMessageCheckService on Delta (docs/behaviour.md §5).

A pass runs when ``transaction_check_interval_ms`` has elapsed since the last one (and
there is something in the half queue). It walks ``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0
from the saved half offset, in offset order, up to what dispatch had indexed when the
pass began. Each entry is, in this order of rules:

1. *settled* — an op record names its ``TRAN_ID``: done, nothing written;
2. *discarded* — ``TRANSACTION_CHECK_TIMES`` ≥ ``transaction_check_max`` or born more
   than ``file_reserved_time_ms`` ago: copied to ``TRANS_CHECK_MAX_TIME_TOPIC``, never
   checked again;
3. *stop* — stored after the pass began (by less than ``transaction_timeout_ms``: a
   producer clock further ahead is not waited for), or without its own
   ``CHECK_IMMUNITY_TIME_IN_SECONDS`` and younger (``now − born_ts``) than
   ``transaction_timeout_ms``: the walk ends here (later entries are younger still);
4. *put back* — younger than its own immunity: written again at the end of the half
   queue unchecked, so it never holds back the entries behind it;
5. *checked* — the producer group's check (listener or table) is asked, with
   ``TRANSACTION_CHECK_TIMES + 1``: COMMIT stores the real message and an op record,
   ROLLBACK an op record, UNKNOWN (or a failing listener) writes the half message again
   at the end of the half queue with the new count.

RocketMQ writes the copy of a checked message before it asks, because the producer
answers later and asynchronously. Here the answer is known inside the pass, and a
COMMIT/ROLLBACK lands in the same commit as the copy would, so the copy is written only
when the answer is UNKNOWN: the same outcome without a copy that would be settled at
once.

Offsets: the half offset moves to the first *stop* entry (or past everything read); the
op offset to the first op record whose transaction still has a half entry at or after
the new half offset — an op whose transaction is behind the half offset is done, so
the op offset never sticks. Every op record from the op offset on is matched by
``TRAN_ID``, and an op record behind it belongs to a transaction with nothing left to
walk, so a transaction with an op record anywhere is never checked (unlike RocketMQ
#8311, #8158, #1517).

Crash safety: the pass's ``now`` is saved before anything is written (``attempt_ts`` of
the half offset row); a re-run resumes that pass with the same ``now``, so every output
gets the same id (``engine_batch_id(now, kind)`` + the half queue offset) and outputs
already stored are skipped. The outputs are one append; the offsets come last. The next
pass waits until dispatch has indexed that append, so the copies it wrote are walked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from deltamq import faults, ids
from deltamq.constants import (
    DISPATCH_GROUP,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    TRANSACTION_GROUP,
    Prop,
    TxState,
)
from deltamq.errors import first_line
from deltamq.message import StoredMessage
from deltamq.tables import deltalog
from deltamq.tables.bodies import join_bodies, read_bodies, restore_columns
from deltamq.tables.consume_queue import int_prop
from deltamq.tables.offsets import advance_offsets, progress
from deltamq.transactions import CheckConfig, ask_state, settle_kinds, table_states, transaction_rows

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.engine import Views
    from deltamq.tables.warehouse import Warehouse

log = logging.getLogger(__name__)

JOB = "check_transactions"
CLASSES = ("settled", "discard", "stop", "putback", "check")
_TXN_KINDS = (ids.KIND_TXN_HALF, ids.KIND_TXN_COMMIT, ids.KIND_TXN_OP, ids.KIND_TXN_DISCARD)


@dataclass(frozen=True)
class CheckState:
    """Saved progress of the check service (``%TRANSACTION%`` rows of ``offsets``)."""

    half_offset: int = 0
    op_offset: int = 0
    last_pass: int | None = None  # now of the last finished pass
    pass_now: int | None = None  # now of a pass begun and not finished
    wait_version: int = -1  # commit_log version holding the last pass's outputs
    head: int = 0  # next offset of the half queue, as dispatch indexed it
    op_head: int = 0  # next offset of the op queue, as dispatch indexed it
    indexed_version: int = -1  # commit_log version dispatch indexed up to


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    ran: bool
    skipped: str | None = None  # interval, idle, dispatch_behind
    pass_now: int | None = None
    resumed: bool = False
    counts: dict[str, int] = field(default_factory=dict)  # per class, of the entries handled
    answers: dict[str, int] = field(default_factory=dict)  # per state, of the checked entries
    listener_errors: int = 0
    error: str | None = None  # per producer group whose check failed: how often, the first cause
    written: int = 0
    already_stored: int = 0
    half_offset: int = 0
    op_offset: int = 0

    @property
    def rows_in(self) -> int:
        return sum(self.counts.values())

    @property
    def details(self) -> dict[str, int]:
        out = {k: v for k, v in self.counts.items()}
        out |= {f"answer_{k.lower()}": v for k, v in self.answers.items()}
        out |= {"listener_errors": self.listener_errors, "already_stored": self.already_stored}
        return out | {"ran": int(self.ran), "resumed": int(self.resumed)}


# --- state ----------------------------------------------------------------------------------
def load_state(wh: Warehouse) -> CheckState:
    """The saved progress, and how far dispatch has indexed the half and op queues (its
    ``%DISPATCH%`` hint rows, read in the same query: written right after each index
    commit, at worst behind it, which only makes a pass walk less or wait)."""
    rows = progress(
        wh, {TRANSACTION_GROUP: None, DISPATCH_GROUP: ("", TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC)}
    )
    mine = {r.topic: r for r in rows[TRANSACTION_GROUP]}
    indexed = {r.topic: r for r in rows[DISPATCH_GROUP]}
    half, op = mine.get(TRANS_HALF_TOPIC), mine.get(TRANS_OP_HALF_TOPIC)
    version = indexed.get("")
    half_head, op_head = indexed.get(TRANS_HALF_TOPIC), indexed.get(TRANS_OP_HALF_TOPIC)
    return CheckState(
        half_offset=(half.next_offset or 0) if half else 0,
        op_offset=(op.next_offset or 0) if op else 0,
        last_pass=op.progress_version if op else None,
        pass_now=half.attempt_ts if half else None,
        wait_version=half.progress_version if half and half.progress_version is not None else -1,
        head=(half_head.next_offset or 0) if half_head else 0,
        op_head=(op_head.next_offset or 0) if op_head else 0,
        indexed_version=version.progress_version if version and version.progress_version is not None else -1,
    )


# --- planning (pure) ------------------------------------------------------------------------
def plan_classes(
    half: DataFrame,
    ops: DataFrame,
    now: int,
    *,
    timeout_ms: int,
    check_max: int,
    retention_ms: int,
) -> DataFrame:
    """Pure plan: half queue entries (consume_queue rows) and op records (``tran_id``) →
    the entries with ``tran_id``, ``times`` (checks so far), ``age`` and ``cls`` (one of
    :data:`CLASSES`, by docs/behaviour.md §5's rules in order)."""
    props = F.col("properties")
    settled = ops.select(F.col("tran_id").alias("op_tran_id")).distinct()
    immunity_raw = props.getItem(Prop.CHECK_IMMUNITY_TIME_IN_SECONDS)
    # RocketMQ's getImmunityTime: seconds × 1000, never below the transaction timeout.
    immunity_ms = F.greatest(
        F.coalesce(int_prop(props, Prop.CHECK_IMMUNITY_TIME_IN_SECONDS, 12) * 1000, F.lit(timeout_ms)),
        F.lit(timeout_ms),
    )
    born = F.coalesce(F.col("born_ts"), F.col("store_ts"))
    entries = (
        half.withColumn("tran_id", F.coalesce(props.getItem(Prop.TRAN_ID), F.col("msg_id")))
        .withColumn("times", F.coalesce(int_prop(props, Prop.TRANSACTION_CHECK_TIMES, 12), F.lit(0)))
        .withColumn("age", F.lit(now) - born)
        .join(F.broadcast(settled), F.col("tran_id") == F.col("op_tran_id"), "left")
    )
    age = F.col("age")
    cls = (
        F.when(F.col("op_tran_id").isNotNull(), "settled")
        .when((F.col("times") >= check_max) | (age > retention_ms), "discard")
        # stored at the pass's now or later: after it began (a pass resumed after a kill
        # meets the copies it wrote itself, stored at exactly its now). A store time is the
        # producer's clock: one ahead by the timeout or more is not waited for (it would
        # hold up every entry behind it as long as the clock is ahead); its age decides
        .when((F.col("store_ts") >= F.lit(now)) & (F.col("store_ts") < F.lit(now + timeout_ms)), "stop")
        # a negative age (producer clock ahead) is checked, as RocketMQ does
        .when(immunity_raw.isNull() & (age >= 0) & (age < timeout_ms), "stop")
        .when(immunity_raw.isNotNull() & (age < immunity_ms), "putback")
        .otherwise("check")
    )
    return entries.withColumn("cls", cls).drop("op_tran_id")


def _with_check_times(props: Column, times: Column) -> Column:
    kept = F.map_filter(props, lambda k, v: k != F.lit(Prop.TRANSACTION_CHECK_TIMES))
    return F.map_concat(kept, F.create_map(F.lit(Prop.TRANSACTION_CHECK_TIMES), times.cast("string")))


def output_kinds() -> Column:
    """What a handled entry writes (``ids.KIND_TXN_*``), by its ``cls`` and ``state``."""
    cls, state = F.col("cls"), F.col("state")

    def one(kind: int) -> Column:
        return F.array(F.lit(kind))

    return (
        F.when(cls == "discard", one(ids.KIND_TXN_DISCARD))
        .when(
            (cls == "putback") | ((cls == "check") & (state == TxState.UNKNOWN.value)), one(ids.KIND_TXN_HALF)
        )
        .when(cls == "check", settle_kinds(state))
        .otherwise(F.array().cast("array<int>"))
    )


def plan_outputs(handled: DataFrame, now: int) -> DataFrame:
    """Pure plan: the handled entries joined to their commit_log row (``real_topic``,
    ``real_qid``, :func:`restore_columns`), with ``cls``, ``times`` and, for checked ones,
    ``state`` → every commit_log row the pass writes, in one projection. Ids derive from
    ``now`` and the half queue offset: ``engine_batch_id(now, kind)`` + the offset."""
    checked_times = F.col("times") + F.when(F.col("cls") == "check", 1).otherwise(0)
    rows = handled.withColumn(
        "orig_props",
        _with_check_times(
            F.coalesce(F.col("orig_props"), F.create_map().cast("map<string,string>")), checked_times
        ),
    )
    return transaction_rows(
        rows,
        output_kinds(),
        store_ts=F.lit(now).cast("bigint"),
        ident=lambda kind: (
            ids.engine_batch_id_col(F.lit(now), kind),
            F.col("queue_offset").bitwiseAND(F.lit(0xFFFFFFFF)),
        ),
    )


# --- reading --------------------------------------------------------------------------------
def system_queue(wh: Warehouse, topic: str, lo: int, hi: int) -> DataFrame:
    """Entries ``[lo, hi)`` of queue 0 of a transaction system topic (pruned by offset)."""
    return wh.read("consume_queue").where(
        (F.col("topic") == F.lit(topic))
        & (F.col("slot") == F.lit(0))
        & (F.col("queue_id") == F.lit(0))
        & (F.col("queue_offset") >= F.lit(lo))
        & (F.col("queue_offset") < F.lit(hi))
    )


def read_ops(wh: Warehouse, lo: int, hi: int) -> DataFrame:
    """Op records ``[lo, hi)``: queue offset and the transaction each settles."""
    return system_queue(wh, TRANS_OP_HALF_TOPIC, lo, hi).select(
        F.col("queue_offset").alias("op_offset"), F.col("properties").getItem(Prop.TRAN_ID).alias("tran_id")
    )


# --- asking ---------------------------------------------------------------------------------
@dataclass
class Failures:
    """Per producer group whose check could not answer: how many entries went unanswered
    (UNKNOWN: asked again at the next pass, counted as a check) and the first cause."""

    by_group: dict[str, tuple[int, str]] = field(default_factory=dict)

    def add(self, group: str, n: int, cause: str) -> None:
        count, first = self.by_group.get(group, (0, cause))
        self.by_group[group] = (count + n, first)

    @property
    def count(self) -> int:
        return sum(n for n, _ in self.by_group.values())

    def text(self) -> str | None:
        """The check job's ``error`` in ``job_runs`` (None: every check answered)."""
        if not self.by_group:
            return None
        return "; ".join(
            f"producer group {g}: {n} unanswered, first: {cause}"
            for g, (n, cause) in sorted(self.by_group.items())
        )


def _answers(
    ctx: Context,
    checked: DataFrame,
    configs: dict[str, CheckConfig],
    with_bodies: Callable[[DataFrame], DataFrame],
) -> tuple[DataFrame, Failures]:
    """(queue_offset, state) of every checked entry (index rows) whose producer group's
    check answered, and the groups whose check failed. Each group is asked on its own: a
    table that cannot be read, a listener that cannot be imported or that raises leaves
    that group's entries UNKNOWN, never another group's. Groups without a check: UNKNOWN.
    A table check joins the index rows (their properties carry the key); only the
    messages a listener is asked about are read with their bodies."""
    spark = ctx.engine.spark
    pg = F.col("properties").getItem(Prop.PGROUP)
    answered: list[tuple[int, str]] = []
    failures = Failures()
    tables = {g: c for g, c in configs.items() if c.is_table_check}
    for group, cfg in sorted(tables.items()):
        mine = checked.where(pg == F.lit(group)).select(
            "queue_offset", F.col("properties").getItem(cfg.key_property).alias("k")
        )
        try:
            got = (
                mine.join(table_states(spark, cfg), F.col("k") == F.col("tc_key"), "left")
                .select("queue_offset", F.coalesce(F.col("tc_state"), F.lit(TxState.UNKNOWN.value)))
                .collect()
            )
        except Exception as e:  # noqa: BLE001 - this group's table only; the others are asked
            cause = f"check table {cfg.table!r} cannot be read: {first_line(e)}"
            log.warning("check of producer group %s: %s", group, cause)
            failures.add(group, mine.count(), cause)
            continue
        answered += [(r[0], r[1]) for r in got]
    callers: dict[str, Callable[..., Any] | str] = {}
    for g, c in configs.items():
        caller = ctx.catalog.check_listeners.get(g) or c.listener
        if not c.is_table_check and caller:
            callers[g] = caller
    if callers:
        from deltamq.consumer import resolve_listener

        asked = with_bodies(checked.where(pg.isin(*sorted(callers))).withColumn("pg", pg))
        rows = asked.withColumn(
            "orig_props", _with_check_times(F.col("orig_props"), F.col("times") + 1)
        ).select("queue_offset", "pg", *_MESSAGE_COLUMNS)
        resolved: dict[str, Any] = {}
        for r in rows.collect():
            group, fn = r["pg"], callers[r["pg"]]
            if isinstance(fn, str):
                try:
                    fn = resolved.setdefault(group, resolve_listener(fn))
                except Exception as e:  # noqa: BLE001 - an unimportable listener answers UNKNOWN
                    log.warning("check listener of %s cannot be imported: %s", group, e)
                    failures.add(group, 1, f"check listener {fn!r} cannot be imported: {first_line(e)}")
                    continue
            state, error = ask_state(fn, _message(r))
            if error is not None:
                failures.add(group, 1, error)
            answered.append((r["queue_offset"], state.value))
    return spark.createDataFrame(answered, "queue_offset bigint, state string"), failures


_MESSAGE_COLUMNS = (
    "tran_id",
    "real_topic",
    "real_qid",
    "tags",
    "keys",
    "body",
    "flag",
    "orig_props",
    "born_ts",
    "store_ts",
    "orig_reconsume",
    "sys_flag",
)


def _message(r: Any) -> StoredMessage:
    """A half message as a check listener sees it: in its real topic and queue."""
    props = dict(r["orig_props"] or {})
    return StoredMessage(
        msg_id=props.get(Prop.UNIQ_KEY) or r["tran_id"],
        topic=r["real_topic"],
        queue_id=r["real_qid"],
        queue_offset=None,
        body=bytes(r["body"]) if r["body"] is not None else b"",
        tags=r["tags"],
        keys=r["keys"],
        properties=props,
        born_ts=r["born_ts"],
        store_ts=r["store_ts"],
        reconsume_times=r["orig_reconsume"] or 0,
        flag=r["flag"] or 0,
        sys_flag=r["sys_flag"] or 0,
    )


# --- running --------------------------------------------------------------------------------
def run(ctx: Context, now: int, *, fence: Callable[[], None] | None = None) -> CheckResult:
    """One check pass at ``now`` if its interval has elapsed (or resume an unfinished one):
    gate → start (save the pass's now) → classify the half queue → handle the entries
    (ask, write the outputs) → move the offsets."""
    wh = ctx.warehouse
    state = load_state(wh)
    skipped = _skip_reason(ctx, state, now)
    if skipped is not None:
        return CheckResult(
            ran=False, skipped=skipped, half_offset=state.half_offset, op_offset=state.op_offset
        )
    resumed = state.pass_now is not None
    pass_now: int = state.pass_now if state.pass_now is not None else now  # resumed: its own now
    if not resumed:
        if fence:
            fence()
        ctx.commit(
            partial(
                advance_offsets,
                wh,
                TRANSACTION_GROUP,
                [(TRANS_HALF_TOPIC, 0, None, None)],
                now,
                attempt_ts=pass_now,
            ),
            what="offsets",
        )
    faults.point("check.after_start_commit")
    ops = read_ops(wh, state.op_offset, state.op_head)
    with ctx.engine.views() as views:
        classified = classify(ctx, views, state, ops, pass_now)
        new_half, counts = classified.new_half, classified.counts
        handled = Handled()
        if counts["discard"] + counts["putback"] + counts["check"]:
            handled = handle(ctx, views, classified, pass_now, resumed, fence)
    new_op = _finish(ctx, state, ops, new_half, handled.wait_version, pass_now, now)
    faults.point("check.after_progress_commit")
    return CheckResult(
        ran=True,
        skipped=None,
        pass_now=pass_now,
        resumed=resumed,
        counts=counts,
        answers=handled.answers,
        listener_errors=handled.failures.count,
        error=handled.failures.text(),
        written=handled.written,
        already_stored=handled.already,
        half_offset=new_half,
        op_offset=new_op,
    )


def _skip_reason(ctx: Context, state: CheckState, now: int) -> str | None:
    """Why no pass runs now (None: one runs): within the interval, dispatch behind the last
    pass's copies, or nothing new in the half queue. An unfinished pass always resumes."""
    resumed = state.pass_now is not None
    if (
        not resumed
        and state.last_pass is not None
        and now - state.last_pass < ctx.config.transaction_check_interval_ms
    ):
        return "interval"
    if state.indexed_version < state.wait_version:
        return "dispatch_behind"  # the last pass's copies are not walkable yet
    if not resumed and state.head <= state.half_offset:
        return "idle"
    return None


@dataclass(frozen=True)
class Classified:
    """The half entries of a pass, classified (:func:`plan_classes`; in the temp view
    ``view`` of the pass's scope), the new half offset and the count per class before it."""

    view: str
    new_half: int
    counts: dict[str, int]


def classify(ctx: Context, views: Views, state: CheckState, ops: DataFrame, pass_now: int) -> Classified:
    """Each half entry's class, the new half offset (the first *stop*, or past everything
    read) and the count per class before it."""
    wh, engine, cfg = ctx.warehouse, ctx.engine, ctx.config
    classified = plan_classes(
        system_queue(wh, TRANS_HALF_TOPIC, state.half_offset, state.head),
        ops,
        pass_now,
        timeout_ms=cfg.transaction_timeout_ms,
        check_max=cfg.transaction_check_max,
        retention_ms=cfg.file_reserved_time_ms,
    )
    view = views.add(classified, "check_half")
    edge = engine.rows(
        "SELECT min(CASE WHEN cls = 'stop' THEN queue_offset END) AS stop_at, "
        f"max(queue_offset) AS hi FROM {view}"
    )[0]
    if edge["stop_at"] is not None:
        new_half = edge["stop_at"]
    elif edge["hi"] is not None:
        new_half = edge["hi"] + 1
    else:
        new_half = state.half_offset
    counts = {c: 0 for c in CLASSES if c != "stop"}
    for r in engine.rows(
        f"SELECT cls, count(*) AS n FROM {view} WHERE queue_offset < {new_half} GROUP BY cls"
    ):
        counts[r["cls"]] = r["n"]
    return Classified(view, new_half, counts)


@dataclass(frozen=True, kw_only=True)
class Handled:
    """What handling a pass's entries stored: answers by state, listener errors, rows
    written (by this attempt; ``already`` by an earlier one), and the commit_log version
    the next pass waits for dispatch to reach (None: nothing written)."""

    answers: dict[str, int] = field(default_factory=dict)
    failures: Failures = field(default_factory=Failures)
    written: int = 0
    already: int = 0
    wait_version: int | None = None


def handle(
    ctx: Context,
    views: Views,
    classified: Classified,
    pass_now: int,
    resumed: bool,
    fence: Callable[[], None] | None,
) -> Handled:
    """Discard, put back or check every entry before ``new_half`` that is not settled, and
    append every output in one commit (entries an earlier attempt of this pass stored are
    skipped whole)."""
    wh, engine = ctx.warehouse, ctx.engine
    spark = engine.spark
    # Entries already handled by an earlier attempt of this same pass (a resumed pass):
    # each entry's outputs share one position (its offset) and land in one append, so
    # an entry with any output stored is skipped whole, whatever a listener says now.
    done_positions, already = _stored_positions(wh, pass_now) if resumed else (None, 0)
    counts = classified.counts
    decided, bodies = _to_handle(ctx, classified, done_positions)

    def with_bodies(index_rows: DataFrame) -> DataFrame:
        return join_bodies(
            index_rows.drop("properties").withColumnRenamed("msg_id", "src_msg_id"),
            bodies,
            [F.col("topic").alias("real_topic"), F.col("queue_id").alias("real_qid"), *restore_columns()],
            msg_id="src_msg_id",
        )

    decided, failures = _with_answers(ctx, decided, counts, with_bodies)
    decided_view = views.add(decided, "check_decided")
    outputs = plan_outputs(with_bodies(spark.table(decided_view)), pass_now)
    # Every entry handled writes at least one row; a resumed pass may have none left.
    left = done_positions is None or engine.rows(f"SELECT 1 FROM {decided_view} LIMIT 1")
    faults.point("check.before_output_commit")
    if left:
        if fence:
            fence()
        ctx.commit(partial(wh.append, "commit_log", outputs), what=JOB)
    faults.point("check.after_output_commit")
    # What the pass (every attempt of it) stored, by kind: the answers follow from it.
    kinds = _stored_kinds(wh, pass_now)
    return Handled(
        answers={
            TxState.COMMIT.value: kinds.get(ids.KIND_TXN_COMMIT, 0),
            TxState.ROLLBACK.value: kinds.get(ids.KIND_TXN_OP, 0) - kinds.get(ids.KIND_TXN_COMMIT, 0),
            TxState.UNKNOWN.value: kinds.get(ids.KIND_TXN_HALF, 0) - counts["putback"],
        },
        failures=failures,
        written=sum(kinds.values()) - already,
        already=already,
        # the next pass waits for dispatch to index this far (the copies written here)
        wait_version=deltalog.latest_version(wh.storage, wh.uri("commit_log")),
    )


def _to_handle(
    ctx: Context, classified: Classified, done_positions: DataFrame | None
) -> tuple[DataFrame, DataFrame]:
    """The entries before ``new_half`` that are not settled (without those an earlier
    attempt stored: ``done_positions``), and their bodies (read by batch-id ranges)."""
    wh, engine = ctx.warehouse, ctx.engine
    new_half = classified.new_half
    todo = engine.spark.table(classified.view).where(
        (F.col("queue_offset") < new_half) & (F.col("cls") != "settled")
    )
    if done_positions is not None:
        todo = todo.join(
            done_positions,
            F.col("queue_offset").bitwiseAND(F.lit(0xFFFFFFFF)) == F.col("done_pos"),
            "left_anti",
        )
    keys = engine.rows(
        f"SELECT DISTINCT cl_batch_id, cl_date FROM {classified.view} "
        f"WHERE queue_offset < {new_half} AND cls <> 'settled'"
    )
    bodies = read_bodies(wh, (r["cl_date"] for r in keys), (r["cl_batch_id"] for r in keys))
    columns = (
        "queue_offset",
        "cls",
        "times",
        "tran_id",
        "properties",
        "store_ts",
        "cl_batch_id",
        "cl_batch_pos",
    )
    return todo.select(*columns, "msg_id"), bodies


def _with_answers(
    ctx: Context,
    decided: DataFrame,
    counts: Mapping[str, int],
    with_bodies: Callable[[DataFrame], DataFrame],
) -> tuple[DataFrame, Failures]:
    """``decided`` with a ``state`` column: the checks' answers for the entries to check
    (UNKNOWN when none came), NULL for the others; and the checks that failed."""
    if not counts["check"]:
        return decided.withColumn("state", F.lit(None).cast("string")), Failures()
    configs = ctx.catalog.check_configs()
    answer_df, failures = _answers(ctx, decided.where(F.col("cls") == "check"), configs, with_bodies)
    state = F.when(F.col("cls") == "check", F.coalesce(F.col("state"), F.lit(TxState.UNKNOWN.value)))
    return decided.join(answer_df, "queue_offset", "left").withColumn("state", state), failures


def _finish(
    ctx: Context,
    state: CheckState,
    ops: DataFrame,
    new_half: int,
    wait_version: int | None,
    pass_now: int,
    now: int,
) -> int:
    """Move the half offset and the op offset (the first op record whose transaction still
    has an entry to walk) and end the pass; returns the new op offset."""
    wh = ctx.warehouse
    pending_op = first_pending_op(wh, new_half, state.head, ops)
    new_op = pending_op if pending_op is not None else max(state.op_head, state.op_offset)
    rows = [(TRANS_HALF_TOPIC, 0, new_half, wait_version), (TRANS_OP_HALF_TOPIC, 0, new_op, pass_now)]
    ctx.commit(partial(advance_offsets, wh, TRANSACTION_GROUP, rows, now, attempt_ts=None), what="offsets")
    return new_op


def _pass_rows(wh: Warehouse, now: int) -> DataFrame:
    """commit_log rows the pass at ``now`` stored (by its batch-id range, which file
    statistics prune)."""
    lo = ids.engine_batch_id(now, min(_TXN_KINDS))
    hi = ids.engine_batch_id(now, max(_TXN_KINDS))
    return wh.read("commit_log").where(
        (F.col("store_date") == F.lit(ids.store_date(now))) & F.col("batch_id").between(lo, hi)
    )


def _stored_positions(wh: Warehouse, now: int) -> tuple[DataFrame | None, int]:
    """Positions (half queue offsets) with an output of the pass at ``now`` already
    stored, and how many rows that is; (None, 0) when there are none."""
    n = _pass_rows(wh, now).count()
    if not n:
        return None, 0
    return _pass_rows(wh, now).select(F.col("batch_pos").alias("done_pos")).distinct(), n


def _stored_kinds(wh: Warehouse, now: int) -> dict[int, int]:
    """Rows the pass at ``now`` stored, per kind (``ids.KIND_TXN_*``)."""
    rows = (
        _pass_rows(wh, now)
        .groupBy(F.col("batch_id").bitwiseAND(F.lit((1 << ids.BATCH_RANDOM_BITS) - 1)).alias("kind"))
        .count()
        .collect()
    )
    return {r["kind"]: r["count"] for r in rows}


def first_pending_op(wh: Warehouse, new_half: int, head: int, ops: DataFrame) -> int | None:
    """Offset of the first op record whose transaction has a half entry in
    ``[new_half, head)`` (not walked yet); None when every op record read is done."""
    waiting = (
        system_queue(wh, TRANS_HALF_TOPIC, new_half, head)
        .select(F.coalesce(F.col("properties").getItem(Prop.TRAN_ID), F.col("msg_id")).alias("w_tran"))
        .distinct()
    )
    row = (
        ops.join(waiting, F.col("tran_id") == F.col("w_tran"))
        .agg(F.min("op_offset").alias("first"))
        .collect()[0]
    )
    first: int | None = row["first"]
    return first


def engine_discards(wh: Warehouse, head: int) -> dict[str, int]:
    """Discarded half messages (TRANS_CHECK_MAX_TIME_TOPIC) per producer group."""
    rows = (
        system_queue(wh, TRANS_CHECK_MAX_TIME_TOPIC, 0, head)
        .groupBy(F.col("properties").getItem(Prop.PGROUP).alias("pg"))
        .count()
        .collect()
    )
    return {r["pg"]: r["count"] for r in rows}
