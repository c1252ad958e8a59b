"""Producers: validated, batched blind appends to ``commit_log``.

Every send is one Delta commit (a blind append, so producers on many machines never
conflict with each other). Validation runs first; a batch with one bad message
stores nothing.

Example:
    >>> producer = ctx.producer("order-service")
    >>> ids = producer.send_batch([Message("orders", b"..."), Message("orders", b"...")])
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame, Row, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from deltamq import ids
from deltamq.constants import Prop, SysFlag, TxState
from deltamq.errors import (
    BodyTooLarge,
    DeltaMQError,
    InvalidDelayLevel,
    InvalidMessage,
    InvalidProperties,
    InvalidTimer,
    InvalidTransaction,
)
from deltamq.message import (
    Message,
    check_timer_horizon,
)
from deltamq.schemas import COMMIT_LOG, TABLES
from deltamq.sending import COMMIT_LOG_ARROW, BaseProducer, Selector
from deltamq.tables.bodies import read_bodies
from deltamq.tables.integrity import faults_named
from deltamq.tables.sqltext import sql_str
from deltamq.transactions import ask_state, settle_input, settle_kinds, state_name, transaction_rows

if TYPE_CHECKING:
    from deltamq.config import BrokerConfig
    from deltamq.context import Context

LocalTransaction = Callable[[Message, Any], Any]
"""RocketMQ's executeLocalTransaction: (message, arg) -> TxState (or its name)."""


@dataclass(frozen=True)
class TransactionHandle:
    """A stored half message: end it with :meth:`Producer.end_transaction`."""

    tran_id: str  # the half message's msg id, kept by every re-written copy (TRAN_ID)
    topic: str
    queue_id: int
    producer_group: str


@dataclass(frozen=True)
class TransactionSendResult:
    """What :meth:`Producer.send_in_transaction` did: the half message, how the local
    transaction ended, and why it is UNKNOWN when the callback raised or answered badly."""

    handle: TransactionHandle
    state: TxState
    error: str | None = None

    @property
    def msg_id(self) -> str:
        return self.handle.tran_id


assert COMMIT_LOG_ARROW.names == COMMIT_LOG.fieldNames()

_STATES = [s.value for s in TxState]
# properties a half message gets from the producer, never from the user's map
_HALF_PROPS = (Prop.TRAN_MSG, Prop.PGROUP, Prop.TRAN_ID, Prop.TRANSACTION_CHECK_TIMES)
_DF_REQUIRED = ("topic", "body")
_DF_OPTIONAL = {
    "tags": T.StringType(),
    "keys": T.StringType(),
    "properties": T.MapType(T.StringType(), T.StringType()),
    "delay_level": T.IntegerType(),
    "flag": T.IntegerType(),
    "queue_id": T.IntegerType(),
    "deliver_at_ms": T.LongType(),
}


class Producer(BaseProducer):
    """Sends messages to one warehouse on behalf of a producer group (``send`` and
    ``send_batch`` from :class:`~deltamq.sending.BaseProducer`; DataFrames and
    transactions here)."""

    ctx: Context  # the Spark producer sends through a Context (its engine and warehouse)

    def _named_faults(self) -> AbstractContextManager[None]:
        """A fault of the store while sending is named (the warehouse, the cause)."""
        return faults_named(self.ctx.warehouse)

    def send_dataframe(self, df: DataFrame, *, queue_key: str | None = None) -> DataFrame:
        """Store every row of ``df`` in one commit; returns a DataFrame of the stored
        ``msg_id, topic, queue_id`` (read back by batch, lazily).

        Columns: ``topic``, ``body`` (binary or string) and optionally ``tags``, ``keys``,
        ``properties`` (map<string,string>), ``delay_level``, ``flag``, ``queue_id``.
        ``queue_key`` names a column whose equal values land in one queue.
        """
        return self._send_dataframe(df, queue_key, transactional=False)

    def send_dataframe_in_transaction(self, df: DataFrame, *, queue_key: str | None = None) -> DataFrame:
        """Store every row of ``df`` as a half message in one commit (the bulk form of
        :meth:`send_in_transaction`); returns ``msg_id, topic, queue_id`` — the msg id is
        the transaction id to pass to :meth:`end_transactions`. Delays are refused."""
        return self._send_dataframe(df, queue_key, transactional=True)

    def _send_dataframe(self, df: DataFrame, queue_key: str | None, *, transactional: bool) -> DataFrame:
        given = frozenset(df.columns)
        df = self._check_dataframe_columns(df, queue_key)
        now = self.ctx.clock.now_ms()
        batch = ids.new_batch_id(now)
        # Every row is checked inside the write itself (one read of the input): a row that
        # breaks a rule fails the write before anything is committed. Only then is the input
        # read again, by _validate_dataframe, for an error that names the rule and the values.
        queues = self._writable_queues()
        problem = _row_problem(queues, now, self.ctx.config, transactional, given)
        checked = df.withColumn(
            "topic",
            F.when(problem.isNull(), F.col("topic")).otherwise(
                F.raise_error(F.concat(F.lit(_REFUSED), problem)).cast("string")
            ),
        )
        rows = plan_send_dataframe(
            checked,
            queues=queues,
            batch_id=batch,
            now_ms=now,
            producer_group=self.group,
            max_level=self.ctx.catalog.max_delay_level(),
            queue_key=queue_key,
            rr_start=random.randrange(1 << 16),
            transactional=transactional,
            given=given,
        )
        try:
            self.ctx.append_commit_log(rows, what="send_dataframe")
        except Exception as e:
            if _REFUSED not in str(e):
                raise
            self._validate_dataframe(df, now, transactional)  # raises the rule's own error
            raise InvalidMessage(f"the DataFrame was refused: {str(e).split(_REFUSED, 1)[1][:200]}") from e
        day = ids.store_date(now)
        return (
            self.ctx.warehouse.read("commit_log")
            .where((F.col("store_date") == F.lit(day)) & (F.col("batch_id") == F.lit(batch)))
            .select("msg_id", "topic", "queue_id")
        )

    def _writable_queues(self) -> dict[str, int]:
        """The queues of every topic a producer may write to."""
        out = {}
        for topic, info in self.ctx.catalog.topics().items():
            try:
                self.ctx.catalog.validate_writable_topic(topic)
            except DeltaMQError:
                continue
            out[topic] = info["queues"]
        return out

    def _validate_dataframe(self, df: DataFrame, now: int, transactional: bool) -> None:
        """The send rules, checked over the whole input with one aggregate: raises the
        error of the first rule a row breaks."""
        stats = df.agg(
            F.collect_set("topic").alias("topics"),
            F.max(F.length("body")).alias("max_body"),
            F.min("delay_level").alias("min_level"),
            F.max("delay_level").alias("max_level"),
            F.max(F.when(F.col("queue_id").isNotNull(), F.col("queue_id"))).alias("max_qid"),
            F.min("queue_id").alias("min_qid"),
            F.count(F.when(F.col("topic").isNull(), 1)).alias("null_topics"),
            F.min(_timer_col()).alias("min_due"),
            F.max(_timer_col()).alias("max_due"),
            F.count(
                F.when(
                    F.col("properties").getItem(Prop.TIMER_DELIVER_MS).isNotNull()
                    & ~F.col("properties").getItem(Prop.TIMER_DELIVER_MS).rlike("^[0-9]{1,18}$"),
                    1,
                )
            ).alias("bad_timers"),
        ).collect()[0]
        if stats["null_topics"]:
            self.ctx.catalog.validate_writable_topic(None)  # raises InvalidTopic naming the rule
        topics = sorted(stats["topics"])
        for topic in topics:
            self.ctx.catalog.validate_writable_topic(topic)
        if stats["max_body"] is not None and stats["max_body"] > self.ctx.config.max_body_bytes:
            raise BodyTooLarge(
                f"a body in the DataFrame is {stats['max_body']} bytes; at most "
                f"{self.ctx.config.max_body_bytes} bytes are allowed"
            )
        if stats["min_level"] is not None and stats["min_level"] < 0:
            raise InvalidDelayLevel(
                f"delay_level {stats['min_level']} is negative; allowed: 0 (no delay) or "
                f"1..{self.ctx.catalog.max_delay_level()}"
            )
        if stats["bad_timers"]:
            raise InvalidTimer(
                f"{stats['bad_timers']} rows have a {Prop.TIMER_DELIVER_MS} property that is not an "
                "absolute time in epoch milliseconds"
            )
        if transactional and (
            (stats["max_level"] is not None and stats["max_level"] > 0) or stats["max_due"] is not None
        ):
            raise InvalidMessage(
                "rows of the DataFrame are delayed (delay_level > 0 or a timer); a transactional "
                "message cannot be delayed: send them without delay_level, deliver_at_ms or "
                f"{Prop.TIMER_DELIVER_MS}"
            )
        for due in (stats["min_due"], stats["max_due"]):
            if due is not None:
                check_timer_horizon(due, now, self.ctx.config.timer_horizon_ms)
        queues = {t: self.ctx.catalog.topic_queues(t) for t in topics}
        if stats["min_qid"] is not None and (
            stats["min_qid"] < 0 or any(stats["max_qid"] >= q for q in queues.values())
        ):
            raise InvalidMessage(
                f"queue_id values {stats['min_qid']}..{stats['max_qid']} are outside a topic's queues "
                f"({', '.join(f'{t}: 0..{q - 1}' for t, q in queues.items())})"
            )

    # --- transactions (docs/behaviour.md §5) -------------------------------------------------------------
    def send_in_transaction(
        self,
        message: Message,
        local_transaction: LocalTransaction,
        arg: Any = None,
        *,
        queue_key: str | None = None,
        selector: Selector | None = None,
    ) -> TransactionSendResult:
        """Store ``message`` as a half message (invisible to consumers), run
        ``local_transaction(message, arg)`` and end the transaction with its answer.

        The answer is a :class:`TxState` (or its name); an exception or any other answer
        counts as ``UNKNOWN``: nothing more is written and check-back asks the producer
        group's check listener later.
        """
        keys = None if queue_key is None else [queue_key]
        stored = self._store([message], keys, selector, arg, transactional=True)
        handle = TransactionHandle(stored.msg_ids[0], stored.topics[0], stored.queue_ids[0], self.group)
        state, error = ask_state(local_transaction, message, arg)
        if state is not TxState.UNKNOWN:
            half = self.ctx.engine.spark.createDataFrame(stored.table)
            self._end(half.withColumn("state", F.lit(state.value)), self.ctx.clock.now_ms())
        return TransactionSendResult(handle, state, error)

    def end_transaction(self, handle: TransactionHandle | str, state: TxState | str) -> None:
        """End one transaction later (the handle of :meth:`send_in_transaction`, or its
        transaction id): COMMIT stores the real message and an op record, ROLLBACK an op
        record, UNKNOWN nothing."""
        tran_id = handle.tran_id if isinstance(handle, TransactionHandle) else handle
        self.end_transactions({tran_id: state})

    def end_transactions(self, states: Mapping[str, TxState | str] | DataFrame) -> dict[str, int]:
        """End many transactions in one commit: a mapping ``tran_id -> state`` or a
        DataFrame with columns ``tran_id`` and ``state`` (COMMIT / ROLLBACK / UNKNOWN).

        Every id must be a half message of this producer group and every state valid, or
        nothing is written. Returns the number of transactions per state.
        """
        given = self._given_states(states)
        n, batches = _check_given_states(given)
        counts = {s.value: 0 for s in TxState}
        if not n:
            return counts
        halves = self._half_messages(batches)
        for r in self._found_states(given, halves):
            counts[r["state"]] = r["n"]
        if counts["COMMIT"] or counts["ROLLBACK"]:
            chosen = halves.join(given, F.col("msg_id") == F.col("tran_id")).drop("tran_id")
            self._end(chosen, self.ctx.clock.now_ms())
        return counts

    def _given_states(self, states: Mapping[str, TxState | str] | DataFrame) -> DataFrame:
        """The states asked, as a DataFrame ``tran_id, state`` with the states' names.

        A DataFrame needs both columns; a mapping's ids must parse as message ids and its
        states be :class:`TxState` values (or their names), else :class:`InvalidTransaction`.
        """
        if isinstance(states, DataFrame):
            missing = [c for c in ("tran_id", "state") if c not in states.columns]
            if missing:
                raise InvalidTransaction(
                    f"end_transactions needs columns tran_id and state; missing {missing} ({states.columns})"
                )
            given = states.select(
                F.col("tran_id").cast("string").alias("tran_id"),
                F.col("state"),
            )
        else:
            pairs = []
            for tran_id, st in dict(states).items():
                try:
                    ids.parse_msg_id(tran_id)
                    pairs.append((tran_id, TxState.of(st).value))
                except ValueError as e:
                    raise InvalidTransaction(f"transaction {tran_id!r}: {e}") from None
            given = self.ctx.engine.spark.createDataFrame(pairs, "tran_id string, state string")
        return given.withColumn("state", state_name(F.col("state")))

    def _half_messages(self, batches: list[int]) -> DataFrame:
        """The stored half messages (prepared, ``TRAN_MSG``) of the producer batches ``batches``."""
        return read_bodies(
            self.ctx.warehouse, (ids.store_date(b >> ids.BATCH_RANDOM_BITS) for b in batches), batches
        ).where(
            (F.col("properties").getItem(Prop.TRAN_MSG) == F.lit("true"))
            & (F.col("sys_flag").bitwiseAND(F.lit(0xC)) == F.lit(SysFlag.TRANSACTION_PREPARED_TYPE))
        )

    def _found_states(self, given: DataFrame, halves: DataFrame) -> list[Row]:
        """The number of transactions ``given`` per state (rows ``state, n``), once every id
        is found among ``halves`` and belongs to this producer group, else
        :class:`InvalidTransaction` naming (up to five of) the ids that are not."""
        found = given.join(
            halves.select(F.col("msg_id").alias("half_id"), F.col("producer_group").alias("pg")),
            F.col("tran_id") == F.col("half_id"),
            "left",
        )
        with self.ctx.engine.views() as views:
            found_view = views.add(found, "end_found")
            problems = self.ctx.engine.rows(
                f"SELECT tran_id, half_id IS NULL AS missing, pg FROM {found_view} "
                f"WHERE half_id IS NULL OR pg <> {sql_str(self.group)} ORDER BY tran_id LIMIT 5"
            )
            by_state = (
                []
                if problems
                else self.ctx.engine.rows(f"SELECT state, count(*) AS n FROM {found_view} GROUP BY state")
            )
        if problems:
            missing = [r["tran_id"] for r in problems if r["missing"]]
            if missing:
                raise InvalidTransaction(f"transactions {missing} are not stored half messages")
            other = {r["tran_id"]: r["pg"] for r in problems}
            raise InvalidTransaction(
                f"transactions {other} belong to other producer groups, not {self.group!r}"
            )
        return by_state

    def _end(self, halves: DataFrame, now: int) -> None:
        """Append the rows that end ``halves`` (commit_log rows + ``state``) in one commit,
        under one fresh producer batch: positions 2k (real message) and 2k+1 (op record)."""
        with self._named_faults():
            self._append_ends(halves, now)

    def _append_ends(self, halves: DataFrame, now: int) -> None:
        batch = ids.new_batch_id(now)
        # one ordered window over the whole batch on purpose: positions are dense
        whole = Window.partitionBy(F.lit(0)).orderBy("msg_id")
        numbered = halves.withColumn("_k", F.row_number().over(whole) - 1)
        rows = transaction_rows(
            settle_input(numbered, F.col("state"), ("_k",)),
            settle_kinds(F.col("state")),
            store_ts=F.lit(now).cast("bigint"),
            ident=lambda kind: (
                F.lit(batch).cast("bigint"),
                F.col("_k") * 2 + F.when(kind == F.lit(ids.KIND_TXN_OP), 1).otherwise(0),
            ),
        )
        self.ctx.append_commit_log(rows, what="end_transaction")

    def _check_dataframe_columns(self, df: DataFrame, queue_key: str | None) -> DataFrame:
        fields = {f.name: f.dataType for f in df.schema.fields}
        missing = [c for c in _DF_REQUIRED if c not in fields]
        if missing:
            raise InvalidMessage(
                f"send_dataframe needs columns {list(_DF_REQUIRED)}; missing {missing} "
                f"(optional: {list(_DF_OPTIONAL)})"
            )
        if queue_key is not None and queue_key not in fields:
            raise InvalidMessage(f"queue_key column {queue_key!r} is not in the DataFrame ({list(fields)})")
        if "properties" in fields and not _is_string_map(fields["properties"]):
            raise InvalidProperties(
                f"properties column has type {fields['properties'].simpleString()}; "
                "it must be map<string,string>"
            )
        if not isinstance(fields["body"], T.BinaryType | T.StringType):
            raise InvalidMessage(
                f"body column has type {fields['body'].simpleString()}; use binary or string"
            )
        if "delay_level" in fields and not isinstance(fields["delay_level"], T.IntegralType):
            raise InvalidDelayLevel(
                f"delay_level column has type {fields['delay_level'].simpleString()}; "
                "it must be an integer type"
            )
        out = df
        for name, dtype in _DF_OPTIONAL.items():
            out = out.withColumn(name, F.col(name).cast(dtype) if name in fields else F.lit(None).cast(dtype))
        return out.withColumn("body", F.col("body").cast("binary"))


def _check_given_states(given: DataFrame) -> tuple[int, list[int]]:
    """Check the states given to :meth:`Producer.end_transactions` in one pass: every state
    allowed, every id a deltamq message id, no id twice (else :class:`InvalidTransaction`).

    Returns the number of transactions and the producer batches their ids name.
    """
    check = given.agg(
        F.count(F.lit(1)).alias("n"),
        F.count(F.when(~F.col("state").isin(*_STATES) | F.col("state").isNull(), 1)).alias("bad_states"),
        F.first(F.when(~F.col("state").isin(*_STATES) | F.col("state").isNull(), F.col("state")), True).alias(
            "bad_state"
        ),
        F.count(
            F.when(~F.coalesce(F.col("tran_id").rlike("^[0-9A-F]{24}([0-9A-F]{8})?$"), F.lit(False)), 1)
        ).alias("bad_ids"),
        F.count_distinct("tran_id").alias("distinct_ids"),
        F.collect_set(F.conv(F.substring("tran_id", 1, 16), 16, 10).cast("bigint")).alias("batches"),
    ).collect()[0]
    if check["bad_states"]:
        raise InvalidTransaction(
            f"{check['bad_states']} states are not allowed (e.g. {check['bad_state']!r}); "
            "allowed: COMMIT, ROLLBACK, UNKNOWN"
        )
    if check["bad_ids"]:
        raise InvalidTransaction(
            f"{check['bad_ids']} transaction ids are not deltamq message ids (24 or 32 upper-case hex digits)"
        )
    if check["distinct_ids"] != check["n"]:
        raise InvalidTransaction(f"{check['n'] - check['distinct_ids']} transaction ids are given twice")
    return check["n"], [b for b in check["batches"] if b is not None]


_REFUSED = "deltamq refused a row: "


def _row_problem(
    queues: dict[str, int],
    now: int,
    config: BrokerConfig,
    transactional: bool,
    given: frozenset[str] | None = None,
) -> Column:
    """Per row of a checked send_dataframe input: which send rule it breaks (a text), or
    null. The same rules as ``_validate_dataframe``, as one expression; the rules about
    optional columns the input did not ``given`` (None: every column) are left out, as
    they cannot be broken (those columns are null)."""
    has = _present(given)
    nq = F.element_at(_queue_map(queues), F.col("topic"))
    problem = F.when(
        F.col("topic").isNull() | nq.isNull(), F.lit("topic is missing, unknown or not writable")
    ).when(F.length("body") > F.lit(config.max_body_bytes), F.lit("body too large"))
    if "delay_level" in has:
        problem = problem.when(F.col("delay_level") < 0, F.lit("negative delay_level"))
    if "properties" in has:
        timer_text = F.col("properties").getItem(Prop.TIMER_DELIVER_MS)
        problem = problem.when(
            timer_text.isNotNull() & ~timer_text.rlike("^[0-9]{1,18}$"), F.lit("malformed timer")
        )
    if "properties" in has or "deliver_at_ms" in has:
        due = _timer_col()
        if transactional:
            delayed = (F.coalesce(F.col("delay_level"), F.lit(0)) > 0) | due.isNotNull()
            problem = problem.when(delayed, F.lit("a transactional message cannot be delayed"))
        problem = problem.when(
            (due > F.lit(now + config.timer_horizon_ms)) | (due < F.lit(now - config.timer_horizon_ms)),
            F.lit("timer beyond the horizon"),
        )
        if "delay_level" in has and "deliver_at_ms" in has:  # as send() refuses deliver_at with a level
            problem = problem.when(
                (F.coalesce(F.col("delay_level"), F.lit(0)) > 0) & F.col("deliver_at_ms").isNotNull(),
                F.lit("both a delay_level and deliver_at_ms; give one of them"),
            )
    elif transactional and "delay_level" in has:
        problem = problem.when(F.col("delay_level") > 0, F.lit("a transactional message cannot be delayed"))
    if "queue_id" in has:
        problem = problem.when(
            (F.col("queue_id") < 0) | (F.col("queue_id") >= nq), F.lit("queue_id outside the topic's queues")
        )
    return problem


def _present(given: frozenset[str] | None) -> frozenset[str]:
    """The optional columns a send_dataframe input has (None: every one)."""
    return frozenset(_DF_OPTIONAL) if given is None else given


def _queue_map(queues: dict[str, int]) -> Column:
    """``topic -> number of queues`` as a map literal, typed even when no topic is
    writable (an untyped empty map cannot be looked up by a string)."""
    return F.create_map(*[x for t, q in queues.items() for x in (F.lit(t), F.lit(q))]).cast("map<string,int>")


def _timer_col() -> Column:
    """A row's absolute due time: ``deliver_at_ms`` or a ``TIMER_DELIVER_MS`` property."""
    raw = F.col("properties").getItem(Prop.TIMER_DELIVER_MS)
    return F.coalesce(F.col("deliver_at_ms"), F.when(raw.rlike("^[0-9]{1,18}$"), raw.cast("bigint")))


def _is_string_map(dtype: T.DataType) -> bool:
    return (
        isinstance(dtype, T.MapType)
        and isinstance(dtype.keyType, T.StringType)
        and isinstance(dtype.valueType, T.StringType)
    )


def _stored_properties(
    has: frozenset[str], max_level: int, producer_group: str, transactional: bool
) -> Column:
    """A stored row's properties: the user's (without the ones deltamq sets), the id, the
    delay level (clamped), the timer and a half message's transaction properties, each
    only when a column the input ``has`` can give it."""
    empty = F.create_map().cast("map<string,string>")
    parts = [F.create_map(F.lit(Prop.UNIQ_KEY), F.col("msg_id"))]
    if "delay_level" in has:
        level = F.least(F.col("delay_level"), F.lit(max_level))
        parts.append(
            F.when(F.col("delay_level") > 0, F.create_map(F.lit(Prop.DELAY), level.cast("string"))).otherwise(
                empty
            )
        )
    if "properties" in has or "deliver_at_ms" in has:
        parts.append(
            F.when(
                F.col("timer_ms").isNotNull(),
                F.create_map(F.lit(Prop.TIMER_DELIVER_MS), F.col("timer_ms").cast("string")),
            ).otherwise(empty)
        )
    if transactional:
        parts.append(
            F.create_map(
                F.lit(Prop.TRAN_MSG),
                F.lit("true"),
                F.lit(Prop.PGROUP),
                F.lit(producer_group),
                F.lit(Prop.TRAN_ID),
                F.col("msg_id"),
            )
        )
    if "properties" in has:
        # what the send sets itself; a half's transaction properties too, as send_in_transaction
        # (a given TRANSACTION_CHECK_TIMES would count checks never made)
        reserved = [Prop.UNIQ_KEY, Prop.DELAY, Prop.TIMER_DELIVER_MS]
        if transactional:
            reserved += [Prop.TRANSACTION_CHECK_TIMES, Prop.TRAN_MSG, Prop.PGROUP, Prop.TRAN_ID]
        user_props = F.map_filter(F.coalesce(F.col("properties"), empty), lambda k, v: ~k.isin(*reserved))
        parts.insert(0, user_props)
    return parts[0] if len(parts) == 1 else F.map_concat(*parts)


def plan_send_dataframe(
    df: DataFrame,
    *,
    queues: dict[str, int],
    batch_id: int,
    now_ms: int,
    producer_group: str,
    max_level: int,
    queue_key: str | None = None,
    rr_start: int = 0,
    transactional: bool = False,
    given: frozenset[str] | None = None,
) -> DataFrame:
    """Pure plan: user rows (topic, body, tags, keys, properties, delay_level, flag,
    queue_id) → commit_log rows. Deterministic given its arguments and row order.
    ``transactional``: half messages (docs/behaviour.md §5). ``given``: the optional
    columns the user's input had (None: all); the others are null, and the expressions
    they feed are left out (a DataFrame of topics and bodies gets its properties map
    from the id alone, with no map filtered or concatenated per row)."""
    has = _present(given)
    # Positions must be unique within the batch, from one evaluation of the plan (no
    # shuffle): monotonically_increasing_id is (partition << 33) + row; packed as
    # (partition << 22) | row when that fits 32 bits (24-digit ids), else kept whole with
    # bit 62 set, above every packed value.
    mid = F.monotonically_increasing_id()
    part, row = F.shiftright(mid, 33), mid.bitwiseAND(F.lit((1 << 33) - 1))
    pos = F.when(
        (row < F.lit(1 << 22)) & (part < F.lit(1 << 10)), F.shiftleft(part, 22).bitwiseOR(row)
    ).otherwise(mid.bitwiseOR(F.lit(1 << 62)))
    nq = F.element_at(_queue_map(queues), F.col("topic"))
    if queue_key is not None:
        chosen: Column = F.pmod(F.crc32(F.col(queue_key).cast("string").cast("binary")), nq)
    else:
        chosen = F.pmod(F.col("batch_pos") + F.lit(rr_start), nq)
    properties = _stored_properties(has, max_level, producer_group, transactional)
    if "properties" in has or "deliver_at_ms" in has:
        df = df.withColumn("timer_ms", _timer_col())
    out = (
        df.withColumn("batch_pos", pos)
        .withColumn("batch_id", F.lit(batch_id).cast("bigint"))
        .withColumn("msg_id", ids.msg_id_col(F.col("batch_id"), F.col("batch_pos")))
        .withColumn(
            "queue_id",
            F.coalesce(F.col("queue_id"), chosen.cast("int")) if "queue_id" in has else chosen.cast("int"),
        )
        .withColumn("properties", properties)
        .withColumn(
            "flag", F.coalesce(F.col("flag"), F.lit(0)).cast("int") if "flag" in has else F.lit(0).cast("int")
        )
        .withColumn("born_ts", F.lit(now_ms).cast("bigint"))
        .withColumn("store_ts", F.lit(now_ms).cast("bigint"))
        .withColumn("reconsume_times", F.lit(0).cast("int"))
        .withColumn(
            "sys_flag",
            F.lit(SysFlag.TRANSACTION_PREPARED_TYPE if transactional else SysFlag.TRANSACTION_NOT_TYPE).cast(
                "int"
            ),
        )
        .withColumn("producer_group", F.lit(producer_group))
        .withColumn("store_date", ids.store_date_col(F.col("store_ts")))
    )
    return out.select(*TABLES["commit_log"].columns)
