"""Great Expectations suites over the warehouse tables, and the conservation check.

One suite per table, derived from ``deltamq/schemas``: the columns and their
types, non-null keys, valid topic names. On top, the invariants that make the tables a
broker (each an expectation over the table or over a derived frame whose ``violation``
column names the offending row, expected to be null):

- ``consume_queue``: ``(topic, queue_id, queue_offset)`` unique; offsets dense per queue
  (above the retained minimum); ``msg_id`` unique; ``reconsume_times`` within
  [0, max + 1]; every dead letter carries a ``DLQ_REASON`` consistent with its counts;
  schedule entries due at or after their store time, timer entries with a due time;
  no half message in a user topic;
- ``offsets``: every group offset within [queue minimum, queue maximum + 1];
- ``conservation``: dispatch lost and repeated nothing, and every message is accounted
  for per group (``deltamq.dq.accounting``).

``run()`` returns a :class:`QualityResult` and appends one ``dq_results`` row per
expectation, so quality over time is a SQL query. Great Expectations is imported here
only (it takes seconds to import).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from deltamq.constants import (
    DISPATCH_GROUP,
    DLQ_PREFIX,
    RETRY_PREFIX,
    SCHEDULE_TOPIC,
    SYSTEM_TOPIC_PREFIXES,
    SYSTEM_TOPICS,
    TIMER_TOPIC,
    TOPIC_MAX_LENGTH,
    TOPIC_PATTERN,
    Prop,
    SysFlag,
)

if TYPE_CHECKING:
    from deltamq.context import Context

SAMPLE = 20
DLQ_REASONS = ("max_reconsume", "negative_level", "poison", "timeout", "orderly_max")

# columns that identify a row and must never be null
KEYS: dict[str, tuple[str, ...]] = {
    "warehouse_meta": ("key",),
    "topic_config": ("topic", "queues", "perm"),
    "group_config": ("consumer_group", "mode"),
    "producer_config": ("producer_group",),
    "subscription": ("consumer_group", "topic", "expression"),
    "schedule_levels": ("level", "delay_ms"),
    "commit_log": ("msg_id", "topic", "queue_id", "store_ts", "batch_id", "batch_pos", "store_date"),
    "consume_queue": ("topic", "queue_id", "queue_offset", "msg_id", "store_ts", "cl_version", "cl_batch_id"),
    "offsets": ("consumer_group", "topic", "queue_id"),
    "deliveries": ("consumer_group", "client_id", "topic", "queue_id", "queue_offset", "receipt_handle"),
    "leases": ("job",),
    "queue_lock": ("consumer_group", "topic", "queue_id"),
    "clients": ("consumer_group", "client_id"),
    "consumed_keys": ("consumer_group", "dedup_key"),
    "job_runs": ("tick_id", "now_ts", "job", "status"),
    "dq_results": ("run_id", "suite", "expectation"),
}
# tables whose topic column holds only topic names
TOPIC_TABLES = ("topic_config", "subscription", "commit_log", "consume_queue")


@dataclass(frozen=True, kw_only=True)
class ExpectationResult:
    suite: str
    expectation: str
    success: bool
    unexpected_count: int | None = None
    sample_ids: tuple[str, ...] = ()
    observed: str | None = None


@dataclass(frozen=True, kw_only=True)
class QualityResult:
    run_id: str
    run_ts: int
    results: tuple[ExpectationResult, ...]

    @property
    def success(self) -> bool:
        return all(r.success for r in self.results)

    @property
    def failures(self) -> list[ExpectationResult]:
        return [r for r in self.results if not r.success]

    def failed(self, suite: str, expectation_prefix: str) -> ExpectationResult | None:
        for r in self.failures:
            if r.suite == suite and r.expectation.startswith(expectation_prefix):
                return r
        return None


# --- the frames -------------------------------------------------------------------------------
def _violations(df: DataFrame, bad: F.Column, name: F.Column) -> DataFrame:
    """``df`` reduced to one column ``violation``: ``name`` where ``bad`` holds, else null."""
    return df.select(F.when(bad, name.cast("string")).alias("violation"))


def dense_frame(ctx: Context) -> DataFrame:
    # the timer index is read by due time, and retention removes its promoted entries one by one
    cq = ctx.warehouse.read("consume_queue").where(F.col("topic") != F.lit(TIMER_TOPIC))
    per_queue = cq.groupBy("topic", "queue_id").agg(
        F.count(F.lit(1)).alias("n"), F.min("queue_offset").alias("lo"), F.max("queue_offset").alias("hi")
    )
    return _violations(
        per_queue,
        F.col("n") != F.col("hi") - F.col("lo") + F.lit(1),
        F.concat_ws(":", "topic", "queue_id"),
    )


def dlq_frame(ctx: Context) -> DataFrame:
    cq = ctx.warehouse.read("consume_queue").where(F.col("topic").startswith(DLQ_PREFIX))
    reason = F.col("properties").getItem(Prop.DLQ_REASON)
    most = F.col("properties").getItem(Prop.MAX_RECONSUME_TIMES).cast("int")
    bad = (
        reason.isNull()
        | ~reason.isin(*DLQ_REASONS)
        | (
            (reason == F.lit("max_reconsume"))
            & (most >= 0)
            & (F.coalesce("reconsume_times", F.lit(0)) <= most)
        )
    )
    return _violations(cq, bad, F.col("msg_id"))


def _system_topic() -> F.Column:
    """Column form of ``constants.is_system_topic`` over ``topic``."""
    topic = F.col("topic")
    out = topic.isin(*SYSTEM_TOPICS)
    for prefix in SYSTEM_TOPIC_PREFIXES:
        out = out | topic.startswith(prefix)
    return out


def reconsume_frame(ctx: Context) -> DataFrame:
    """A copy's retry count is within [0, its group's max + 1] (unbounded for a group that
    retries forever); a message in a user topic has not been retried."""
    cq = ctx.warehouse.read("consume_queue")
    home = F.coalesce(F.col("properties").getItem(Prop.REAL_TOPIC), F.col("topic"))
    group = F.when(
        home.startswith(RETRY_PREFIX) | home.startswith(DLQ_PREFIX), F.regexp_replace(home, "^%[A-Z]+%", "")
    )
    limit = F.lit(None).cast("int")
    for g, cfg in ctx.catalog.groups().items():
        limit = F.when(group == F.lit(g), F.lit(cfg.max_reconsume_times)).otherwise(limit)
    k = F.coalesce(F.col("reconsume_times"), F.lit(0))
    bad = (k < 0) | (~_system_topic() & (k != 0)) | (limit.isNotNull() & (limit >= 0) & (k > limit + 1))
    return _violations(cq, bad, F.col("msg_id"))


def due_frame(ctx: Context) -> DataFrame:
    cq = ctx.warehouse.read("consume_queue").where(F.col("topic").isin(SCHEDULE_TOPIC, TIMER_TOPIC))
    bad = F.col("due_ts").isNull() | (
        (F.col("topic") == SCHEDULE_TOPIC) & (F.col("due_ts") < F.col("store_ts"))
    )
    return _violations(cq, bad, F.col("msg_id"))


def half_frame(ctx: Context) -> DataFrame:
    wh = ctx.warehouse
    cq = (
        wh.read("consume_queue")
        .where(~_system_topic() & (F.col("properties").getItem(Prop.TRAN_MSG) == F.lit("true")))
        .select("msg_id", "cl_batch_id", "cl_batch_pos")
    )
    cl = wh.read("commit_log").select(
        F.col("msg_id").alias("l_id"),
        F.col("batch_id").alias("l_batch"),
        F.col("batch_pos").alias("l_pos"),
        "sys_flag",
    )
    joined = cq.join(
        cl,
        (F.col("cl_batch_id") == F.col("l_batch"))
        & (F.col("cl_batch_pos") == F.col("l_pos"))
        & (F.col("msg_id") == F.col("l_id")),
    )
    prepared = F.col("sys_flag").bitwiseAND(F.lit(12)) == F.lit(SysFlag.TRANSACTION_PREPARED_TYPE)
    return _violations(joined, prepared, F.col("msg_id"))


def offsets_frame(ctx: Context) -> DataFrame:
    wh = ctx.warehouse
    # a queue retention emptied altogether keeps its head in dispatch's progress rows
    dispatched = (
        wh.read("offsets")
        .where((F.col("consumer_group") == DISPATCH_GROUP) & (F.col("queue_id") >= 0))
        .select("topic", "queue_id", (F.col("next_offset") - 1).alias("d_top"))
    )
    bounds = (
        wh.read("consume_queue")
        .groupBy("topic", "queue_id")
        .agg(F.min("queue_offset").alias("lo"), F.max("queue_offset").alias("top"))
        .join(dispatched, ["topic", "queue_id"], "full")
        .select(
            F.col("topic").alias("b_topic"),
            F.col("queue_id").alias("b_qid"),
            "lo",
            F.greatest("top", "d_top").alias("hi"),
        )
    )
    offs = wh.read("offsets").where(~F.col("consumer_group").startswith("%"))
    joined = offs.join(
        bounds, (F.col("topic") == F.col("b_topic")) & (F.col("queue_id") == F.col("b_qid")), "left"
    )
    nxt = F.coalesce(F.col("next_offset"), F.lit(0))
    bad = (F.col("lo").isNotNull() & (nxt < F.col("lo"))) | (nxt > F.coalesce(F.col("hi"), F.lit(-1)) + 1)
    name = F.concat(
        F.col("consumer_group"),
        F.when(F.col("client_id") != "", F.concat(F.lit("/"), F.col("client_id"))).otherwise(F.lit("")),
        F.lit(" "),
        F.col("topic"),
        F.lit(":"),
        F.col("queue_id").cast("string"),
        F.lit(" next_offset="),
        nxt.cast("string"),
    )
    return _violations(joined, bad, name)


# --- the suites -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    suite: str
    name: str  # the frame's name (the table, or table.invariant)
    build: Callable[[Context], DataFrame]
    expectations: Callable[[Any, Context], list[Any]]  # (gx module, ctx) -> expectations


def _named(exp: Any, name: str) -> Any:
    exp.meta = {"name": name}
    return exp


def _table_expectations(table: str) -> Callable[[Any, Context], list[Any]]:
    def build(gx: Any, ctx: Context) -> list[Any]:
        from deltamq.schemas import TABLES

        spec = TABLES[table]
        ex = gx.expectations
        out = [
            # as a set: engines order partition columns differently (Sail reads them last)
            _named(
                ex.ExpectTableColumnsToMatchSet(column_set=list(spec.columns), exact_match=True),
                "columns as in the schema",
            )
        ]
        for f in spec.schema.fields:
            out.append(
                _named(
                    ex.ExpectColumnValuesToBeOfType(column=f.name, type_=type(f.dataType).__name__),
                    f"type of {f.name} is {f.dataType.simpleString()}",
                )
            )
        for k in KEYS.get(table, ()):
            out.append(_named(ex.ExpectColumnValuesToNotBeNull(column=k), f"{k} not null"))
        if table in TOPIC_TABLES:
            out.append(
                _named(
                    ex.ExpectColumnValuesToMatchRegex(column="topic", regex=TOPIC_PATTERN.pattern),
                    "topic valid",
                )
            )
            out.append(
                _named(
                    ex.ExpectColumnValueLengthsToBeBetween(
                        column="topic", min_value=1, max_value=TOPIC_MAX_LENGTH
                    ),
                    "topic length",
                )
            )
        if table == "consume_queue":
            out.append(
                _named(
                    ex.ExpectCompoundColumnsToBeUnique(column_list=["topic", "queue_id", "queue_offset"]),
                    "(topic, queue_id, queue_offset) unique",
                )
            )
            out.append(_named(ex.ExpectColumnValuesToBeUnique(column="msg_id"), "msg_id unique"))
        return out

    return build


def _violation(name: str) -> Callable[[Any, Context], list[Any]]:
    return lambda gx, ctx: [_named(gx.expectations.ExpectColumnValuesToBeNull(column="violation"), name)]


def _read_table(b: Context, table: str) -> DataFrame:
    return b.warehouse.read(table)


def frames(tables: Sequence[str] | None = None) -> list[Frame]:
    from deltamq.schemas import TABLES

    out = [
        Frame(t, t, partial(_read_table, table=t), _table_expectations(t))
        for t in TABLES
        if tables is None or t in tables
    ]
    derived = [
        Frame("consume_queue", "consume_queue.dense", dense_frame, _violation("offsets dense per queue")),
        Frame(
            "consume_queue",
            "consume_queue.dlq",
            dlq_frame,
            _violation("dead letters carry a DLQ_REASON consistent with their counts"),
        ),
        Frame(
            "consume_queue",
            "consume_queue.reconsume",
            reconsume_frame,
            _violation("reconsume_times within [0, group max + 1]"),
        ),
        Frame(
            "consume_queue",
            "consume_queue.due",
            due_frame,
            _violation("schedule entries due at or after store"),
        ),
        Frame(
            "consume_queue", "consume_queue.half", half_frame, _violation("no half message in a user topic")
        ),
        Frame("offsets", "offsets.range", offsets_frame, _violation("group offsets within [min, max + 1]")),
    ]
    return out + [f for f in derived if tables is None or f.suite in tables]


# --- running -----------------------------------------------------------------------------------
def _gx_context():
    # Great Expectations logs some 200 INFO lines of its own as it is imported (docs
    # registration): a scheduler's task log would be mostly that. Quiet it, unless the
    # user set a level for it.
    gx_log = logging.getLogger("great_expectations")
    quiet = gx_log.level == logging.NOTSET
    if quiet:
        gx_log.setLevel(logging.WARNING)
    import great_expectations as gx

    if quiet:  # some of its modules set INFO on their own loggers: let them inherit
        for name, child in list(logging.root.manager.loggerDict.items()):
            if name.startswith("great_expectations.") and isinstance(child, logging.Logger):
                if logging.NOTSET < child.level < logging.WARNING:
                    child.setLevel(logging.NOTSET)
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return gx, ctx


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def run_frames(ctx: Context, selected: list[Frame]) -> list[ExpectationResult]:
    gx, gx_ctx = _gx_context()
    source = gx_ctx.data_sources.add_spark(name="deltamq")
    results = []
    for frame in selected:
        asset = source.add_dataframe_asset(name=frame.name)
        batch = asset.add_batch_definition_whole_dataframe("all")
        suite = gx_ctx.suites.add(gx.ExpectationSuite(name=frame.name))
        for exp in frame.expectations(gx, ctx):
            suite.add_expectation(exp)
        vd = gx_ctx.validation_definitions.add(
            gx.ValidationDefinition(name=frame.name, data=batch, suite=suite)
        )
        res = vd.run(
            batch_parameters={"dataframe": frame.build(ctx)},
            result_format={"result_format": "SUMMARY", "partial_unexpected_count": SAMPLE},
        )
        for r in res.results:
            meta = r.expectation_config.meta or {}
            info = r.result or {}
            sample = tuple(_text(v) for v in (info.get("partial_unexpected_list") or []) if v is not None)
            error = (r.exception_info or {}).get("exception_message") if not r.success else None
            observed = info.get("observed_value")
            results.append(
                ExpectationResult(
                    suite=frame.suite,
                    expectation=meta.get("name") or r.expectation_config.type,
                    success=bool(r.success),
                    unexpected_count=info.get("unexpected_count"),
                    sample_ids=tuple(dict.fromkeys(sample)),
                    observed=error or (None if observed is None else _text(observed)[:500]),
                )
            )
    return results


def conservation_results(ctx: Context) -> list[ExpectationResult]:
    from deltamq.dq.accounting import account
    from deltamq.dq.conservation import check_dispatch

    d = check_dispatch(ctx.warehouse, dispatched_only=True)
    out = [
        ExpectationResult(
            suite="conservation",
            expectation="every stored message indexed once",
            success=not (d.unindexed or d.duplicated or d.orphans),
            unexpected_count=len(d.unindexed) + len(d.duplicated) + len(d.orphans),
            sample_ids=tuple([*d.unindexed, *d.duplicated, *d.orphans][:SAMPLE]),
            observed=d.describe(),
        )
    ]
    acc = account(ctx)
    lost = acc.unaccounted
    counts = {g.group: g.counts for g in acc.groups}
    out.append(
        ExpectationResult(
            suite="conservation",
            expectation="every message accounted for per group",
            success=not lost,
            unexpected_count=len(lost),
            sample_ids=tuple(f"{g} {m}: {why}" for g, m, why in lost[:SAMPLE]),
            observed="; ".join(
                f"{g}: " + " ".join(f"{k}={v}" for k, v in c.items() if v) for g, c in counts.items()
            )[:2000],
        )
    )
    return out


def run(
    ctx: Context, *, tables: Sequence[str] | None = None, now: int | None = None, record: bool = True
) -> QualityResult:
    """Every suite (or those of ``tables``; ``"conservation"`` names the conservation
    check), recorded in ``dq_results`` unless ``record`` is false."""
    from deltamq.errors import ConfigError
    from deltamq.schemas import TABLES

    known = [*TABLES, "conservation"]
    if isinstance(tables, str):
        tables = [tables]  # one table by name, not its letters
    if tables is not None and not list(tables):
        raise ConfigError(f"tables=[] selects no suite; give None for every suite, or some of {known}")
    for t in tables or ():
        if t not in known:
            raise ConfigError(f"no suite for {t!r}; suites are {known}")
    now = ctx.clock.now_ms() if now is None else int(now)
    results = run_frames(ctx, frames(tables))
    if tables is None or "conservation" in tables:
        results += conservation_results(ctx)
    result = QualityResult(run_id=f"{now:013d}-{secrets.token_hex(4)}", run_ts=now, results=tuple(results))
    if record:
        _record(ctx, result)
    return result


def _record(ctx: Context, result: QualityResult) -> None:
    rows = [
        (
            result.run_id,
            result.run_ts,
            r.suite,
            r.expectation,
            r.success,
            r.observed,
            r.unexpected_count,
            list(r.sample_ids),
        )
        for r in result.results
    ]
    df = ctx.engine.spark.createDataFrame(
        rows,
        "run_id string, run_ts bigint, suite string, expectation string, success boolean, observed string, "
        "unexpected_count bigint, sample_ids array<string>",
    )
    ctx.commit(lambda: ctx.warehouse.append("dq_results", df), what="dq_results")
