"""Transactional messages (docs/behaviour.md §5): ending transactions and the producer groups' checks.

A half message is a ``commit_log`` row in its real topic and queue with ``TRAN_MSG=true``,
``PGROUP``, ``TRAN_ID`` (its own msg id; every re-written copy keeps it) and the
prepared ``sys_flag``; dispatch indexes it in ``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0, where
no consumer sees it. Ending a transaction writes, in one commit:

- ``COMMIT``: the real message (the half's columns, committed ``sys_flag``, stored now)
  and an op record;
- ``ROLLBACK``: an op record;
- ``UNKNOWN``: nothing.

An op record is a message of ``RMQ_SYS_TRANS_OP_HALF_TOPIC`` queue 0 with tag ``d``,
``TRAN_ID`` and ``TRAN_STATE`` properties and the transaction id as body.

Check-back (``deltamq/jobs/check_transactions.py``) asks the producer group how an old
unsettled transaction ended: a listener ``fn(message) -> TxState`` (a callable in the
same process or an import path stored in ``producer_config``), or a *table check*: one
join of the pass's half messages with a Delta table of local transaction state.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from deltamq import ids
from deltamq.constants import (
    OP_TAG,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_OP_HALF_TOPIC,
    TX_ALIASES,
    Prop,
    SysFlag,
    TxState,
)
from deltamq.errors import ConfigError, first_line
from deltamq.schemas import TABLES
from deltamq.tables.bodies import restore_columns

log = logging.getLogger(__name__)

CheckListener = Callable[[Any], Any]
"""``fn(message: StoredMessage) -> TxState`` (or a state name)."""


def settle_input(half_rows: DataFrame, state: Column, extra: tuple[str, ...] = ()) -> DataFrame:
    """commit_log rows of half messages + a state column (and the ``extra`` columns of
    ``half_rows``) → the input of :func:`transaction_rows`."""
    return half_rows.select(
        F.col("topic").alias("real_topic"),
        F.col("queue_id").alias("real_qid"),
        F.coalesce(F.col("properties").getItem(Prop.TRAN_ID), F.col("msg_id")).alias("tran_id"),
        state.alias("state"),
        *restore_columns(),
        *extra,
    )


def settle_kinds(state: Column) -> Column:
    """The rows that end a transaction in ``state``: COMMIT → the real message and an op
    record, ROLLBACK → an op record, anything else → none."""
    return (
        F.when(
            state == F.lit(TxState.COMMIT.value), F.array(F.lit(ids.KIND_TXN_COMMIT), F.lit(ids.KIND_TXN_OP))
        )
        .when(state == F.lit(TxState.ROLLBACK.value), F.array(F.lit(ids.KIND_TXN_OP)))
        .otherwise(F.array().cast("array<int>"))
    )


def transaction_rows(
    rows: DataFrame,
    kinds: Column,
    *,
    store_ts: Column,
    ident: Callable[[Column], tuple[Column, Column]],
) -> DataFrame:
    """Pure plan: half messages (:func:`settle_input` columns, ``orig_props`` already as
    the outputs should carry them) → the commit_log rows of the ``kinds`` (an array of
    ``ids.KIND_TXN_*`` per row) in one projection, each row read once:

    - ``KIND_TXN_HALF``: the half message again, at the end of the half queue;
    - ``KIND_TXN_COMMIT``: the real message (committed ``sys_flag``);
    - ``KIND_TXN_OP``: an op record naming ``tran_id`` with ``TRAN_STATE`` = ``state``;
    - ``KIND_TXN_DISCARD``: the half message in ``TRANS_CHECK_MAX_TIME_TOPIC``.

    ``ident(kind)`` gives each output's (batch id, position).
    """
    kind = F.col("kind")
    is_op = kind == F.lit(ids.KIND_TXN_OP)
    is_discard = kind == F.lit(ids.KIND_TXN_DISCARD)
    is_commit = kind == F.lit(ids.KIND_TXN_COMMIT)
    props = F.coalesce(F.col("orig_props"), F.create_map().cast("map<string,string>"))
    real = F.create_map(
        F.lit(Prop.REAL_TOPIC), F.col("real_topic"), F.lit(Prop.REAL_QID), F.col("real_qid").cast("string")
    )
    op_props = F.create_map(
        F.lit(Prop.TRAN_ID),
        F.col("tran_id"),
        F.lit(Prop.TRAN_STATE),
        F.col("state"),
        F.lit(Prop.PGROUP),
        F.coalesce(props.getItem(Prop.PGROUP), F.col("producer_group")),
        F.lit(Prop.REAL_TOPIC),
        F.col("real_topic"),
    )
    committed_flag = (
        F.col("sys_flag").bitwiseAND(F.lit(~0xC)).bitwiseOR(F.lit(SysFlag.TRANSACTION_COMMIT_TYPE))
    )
    batch_id, batch_pos = ident(kind)
    out = rows.withColumn("kind", F.explode(kinds)).select(
        ids.msg_id_col(batch_id, batch_pos).alias("msg_id"),
        F.when(is_op, F.lit(TRANS_OP_HALF_TOPIC))
        .when(is_discard, F.lit(TRANS_CHECK_MAX_TIME_TOPIC))
        .otherwise(F.col("real_topic"))
        .alias("topic"),
        F.when(is_op | is_discard, F.lit(0)).otherwise(F.col("real_qid")).cast("int").alias("queue_id"),
        F.when(is_op, F.lit(OP_TAG)).otherwise(F.col("tags")).alias("tags"),
        F.when(is_op, F.lit(None).cast("string")).otherwise(F.col("keys")).alias("keys"),
        F.when(is_op, F.encode(F.col("tran_id"), "UTF-8")).otherwise(F.col("body")).alias("body"),
        F.when(is_op, F.lit(0)).otherwise(F.col("flag")).cast("int").alias("flag"),
        F.when(is_op, op_props)
        .when(
            is_discard,
            F.map_concat(F.map_filter(props, lambda k, v: ~k.isin(Prop.REAL_TOPIC, Prop.REAL_QID)), real),
        )
        .otherwise(props)
        .alias("properties"),
        F.when(is_op, store_ts).otherwise(F.col("born_ts")).cast("bigint").alias("born_ts"),
        store_ts.cast("bigint").alias("store_ts"),
        F.when(is_op | is_commit, F.lit(0))
        .otherwise(F.col("orig_reconsume"))
        .cast("int")
        .alias("reconsume_times"),
        F.when(is_op, F.lit(SysFlag.TRANSACTION_NOT_TYPE))
        .when(is_commit, committed_flag)
        .otherwise(F.col("sys_flag"))
        .cast("int")
        .alias("sys_flag"),
        F.col("producer_group"),
        batch_id.cast("bigint").alias("batch_id"),
        batch_pos.cast("bigint").alias("batch_pos"),
        ids.store_date_col(store_ts).alias("store_date"),
    )
    return out.select(*TABLES["commit_log"].columns)


# --- producer groups' checks ------------------------------------------------------------------
@dataclass(frozen=True)
class CheckConfig:
    """How one producer group answers check-back (a row of ``producer_config``)."""

    group: str
    listener: str | None = None
    table: str | None = None
    key_property: str | None = None
    key_column: str | None = None
    state_expression: str | None = None

    @property
    def is_table_check(self) -> bool:
        return self.table is not None


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _is_path(table: str) -> bool:
    """A Delta path (``/…``, ``file:…``, ``s3://…``, ``hdfs:/…``) rather than a table name."""
    return table.startswith("/") or bool(_SCHEME.match(table))


def read_table(spark: SparkSession, table: str) -> DataFrame:
    """A table check's table: a Delta path (``/…``, ``file:…`` or ``scheme://…``) or a
    table name."""
    if _is_path(table):
        return spark.read.format("delta").load(table)
    return spark.table(table)


def state_name(value: Column) -> Column:
    """A state column in upper case with RocketMQ's spellings (``COMMIT_MESSAGE``, …)
    turned into ours; any other text is kept (for the caller to accept or refuse)."""
    v = F.upper(F.trim(value.cast("string")))
    out = v
    for alias, state in TX_ALIASES.items():
        out = F.when(v == F.lit(alias), F.lit(state)).otherwise(out)
    return out


def normalized_state(value: Column) -> Column:
    """A state expression's value as COMMIT / ROLLBACK / UNKNOWN (NULL and anything else:
    UNKNOWN; RocketMQ's COMMIT_MESSAGE / ROLLBACK_MESSAGE spellings accepted)."""
    v = state_name(value)
    return F.when(v.isin(TxState.COMMIT.value, TxState.ROLLBACK.value), v).otherwise(
        F.lit(TxState.UNKNOWN.value)
    )


def table_states(spark: SparkSession, cfg: CheckConfig) -> DataFrame:
    """(key, state) per business key of a table check. A key whose rows disagree is
    UNKNOWN (asked again at the next check)."""
    assert cfg.table and cfg.key_column and cfg.state_expression
    t = read_table(spark, cfg.table)
    per_row = t.select(
        F.col(cfg.key_column).cast("string").alias("tc_key"),
        normalized_state(F.expr(cfg.state_expression)).alias("tc_state"),
    ).where(F.col("tc_key").isNotNull())
    lo, hi = F.min("tc_state"), F.max("tc_state")
    return per_row.groupBy("tc_key").agg(
        F.when(lo == hi, lo).otherwise(F.lit(TxState.UNKNOWN.value)).alias("tc_state")
    )


def validate_table_check(spark: SparkSession, cfg: CheckConfig) -> None:
    """Raise ConfigError naming what is wrong: the table cannot be read, the key column is
    missing, or the state expression does not evaluate over the table."""
    table = cfg.table or ""
    relative = "/" in table or "\\" in table or table.startswith(".")
    if not _is_path(table) and relative and "`" not in table:  # delta.`/p` is a table name
        raise ConfigError(
            f"check table {table!r} is a relative path; give an absolute path or a URI of a Delta "
            "table (the tick may run in another folder), or a table name"
        )
    try:
        t = read_table(spark, table)
        columns = t.columns
    except Exception as e:  # noqa: BLE001 - any read failure is reported with the table name
        raise ConfigError(f"check table {cfg.table!r} cannot be read: {first_line(e)}") from e
    if cfg.key_column not in columns:
        raise ConfigError(
            f"check table {cfg.table!r} has no key column {cfg.key_column!r}; its columns are {columns}"
        )
    try:
        t.select(normalized_state(F.expr(cfg.state_expression or ""))).limit(1).collect()
    except Exception as e:  # noqa: BLE001 - parse and analysis errors alike
        raise ConfigError(
            f"state expression {cfg.state_expression!r} does not evaluate over {cfg.table!r}: "
            f"{first_line(e)}; write e.g. CASE WHEN status = 'PAID' THEN 'COMMIT' "
            "WHEN status = 'CANCELLED' THEN 'ROLLBACK' END"
        ) from e


def ask_state(fn: Callable[..., Any], *args: Any) -> tuple[TxState, str | None]:
    """A local transaction's or a check listener's answer, and why it is UNKNOWN when it
    is: an exception or an answer that is not a state counts as UNKNOWN (check-back asks
    again at the next pass)."""
    try:
        answer = fn(*args)
    except Exception as e:  # noqa: BLE001 - a failing listener means "unknown"
        log.warning("transaction state callback %r raised: %s", fn, e)
        return TxState.UNKNOWN, f"{type(e).__name__}: {e}"
    try:
        return TxState.of(answer), None
    except ValueError as e:
        return TxState.UNKNOWN, str(e)


__all__ = [
    "CheckConfig",
    "CheckListener",
    "TxState",
    "ask_state",
    "normalized_state",
    "read_table",
    "settle_input",
    "settle_kinds",
    "transaction_rows",
    "table_states",
    "validate_table_check",
]
