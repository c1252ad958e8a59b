"""Idempotent consumption (docs/behaviour.md §7): a group may skip messages whose key it already
consumed successfully within a window.

The key is ``UNIQ_KEY`` (the producer's message id, kept by retries and re-stored
copies), ``KEYS`` (the message's business keys) or a Spark SQL expression over the
``consume_queue`` row (``properties``, ``tags``, ``keys``, …). Consumed keys live in
``consumed_keys`` (group, key, msg id, first success time). A pass marks its taken
messages against them with one join restricted to the window (``first_ts`` grows with
time, so file statistics prune the older files), records the keys of what it consumed
before it advances its offsets (so a re-run after a kill skips them), and deletes keys
older than the window once the oldest kept one has fallen out of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from deltamq.constants import Prop
from deltamq.errors import ConfigError
from deltamq.schemas import SCHEMA_VERSION, TABLES
from deltamq.tables.sqltext import sql_long, sql_str

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from deltamq.config import CommitPolicy, GroupConfig
    from deltamq.tables.warehouse import Warehouse

DEFAULT_WINDOW_MS = 24 * 3_600_000


def key_column(dedup_key: str) -> Column:
    """The dedup key of a consume_queue row."""
    if dedup_key.upper() == "UNIQ_KEY":
        return F.col("properties").getItem(Prop.UNIQ_KEY)
    if dedup_key.upper() == "KEYS":
        return F.col("keys")
    return F.expr(dedup_key).cast("string")


def validate(spark: SparkSession, dedup_key: Any) -> str | None:
    """``dedup_key`` as stored: None (off), UNIQ_KEY, KEYS or an expression that
    evaluates over a consume_queue row; ConfigError naming the problem otherwise."""
    if dedup_key is None:
        return None
    if not isinstance(dedup_key, str) or not dedup_key.strip():
        raise ConfigError(f"dedup_key={dedup_key!r} must be UNIQ_KEY, KEYS or an SQL expression")
    if dedup_key.upper() in ("UNIQ_KEY", "KEYS"):
        return dedup_key.upper()
    empty = spark.createDataFrame([], TABLES["consume_queue"].columns_at(SCHEMA_VERSION))
    try:
        empty.select(key_column(dedup_key)).schema  # noqa: B018 - forces analysis
    except Exception as e:  # noqa: BLE001 - parse and analysis errors alike
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"dedup_key {dedup_key!r} does not evaluate over a consume_queue row: {first}; use UNIQ_KEY, "
            "KEYS or an expression such as properties['order_id']"
        ) from e
    return dedup_key


def mark(wh: Warehouse, taken: DataFrame, groups: dict[str, GroupConfig], now: int) -> DataFrame:
    """``taken`` (consume_queue rows with ``consumer_group``) + ``dkey`` (NULL for groups
    without de-duplication) and ``dup`` (the key was consumed within the window)."""
    deduped = {g: cfg for g, cfg in groups.items() if cfg.dedup_key}
    if not deduped:
        return taken.withColumn("dkey", F.lit(None).cast("string")).withColumn("dup", F.lit(False))
    key = F.lit(None).cast("string")
    window = F.lit(None).cast("bigint")
    for g, cfg in sorted(deduped.items()):
        key = F.when(F.col("consumer_group") == g, key_column(cfg.dedup_key or "")).otherwise(key)
        window = F.when(F.col("consumer_group") == g, F.lit(_window(cfg))).otherwise(window)
    widest = max(_window(cfg) for cfg in deduped.values())
    consumed = (
        wh.read("consumed_keys")
        .where(F.col("consumer_group").isin(*sorted(deduped)) & (F.col("first_ts") >= F.lit(now - widest)))
        .groupBy(F.col("consumer_group").alias("ck_group"), F.col("dedup_key").alias("ck_key"))
        .agg(F.max("first_ts").alias("ck_ts"))
    )
    marked = taken.withColumn("dkey", key).withColumn("dwin", window)
    joined = marked.join(
        consumed,
        (F.col("consumer_group") == F.col("ck_group"))
        & (F.col("dkey") == F.col("ck_key"))
        & (F.col("ck_ts") >= F.lit(now) - F.col("dwin")),
        "left",
    )
    return joined.withColumn("dup", F.col("ck_key").isNotNull()).drop("ck_group", "ck_key", "ck_ts", "dwin")


def later_copies(taken: DataFrame, groups: dict[str, GroupConfig], eligible: Column) -> DataFrame:
    """``taken`` (marked by :func:`mark`) + ``later``: the row is a copy of a key that an
    earlier row of the same pass (by store time, then queue position) also holds, among the
    ``eligible`` rows (those the listener would get) of concurrently consumed groups. Such
    a copy waits for the first one's outcome: consumed, the copy is a duplicate; failed,
    the copy is delivered (deliver sends it back to be checked again, ``LATER_COPY``)."""
    concurrent = sorted(g for g, cfg in groups.items() if cfg.dedup_key and not cfg.orderly)
    if not concurrent:
        return taken.withColumn("later", F.lit(False))
    keyed = F.col("dkey").isNotNull() & ~F.col("dup")
    candidate = eligible & keyed & F.col("consumer_group").isin(*concurrent)
    # rows that are no candidate each in a window of their own (by msg id): spread over
    # the engine's tasks, not sorted together in one
    flagged = taken.withColumn("_candidate", candidate).withColumn(
        "_copies", F.when(F.col("_candidate"), F.col("dkey")).otherwise(F.col("msg_id"))
    )
    copies = Window.partitionBy("consumer_group", "client_id", "_copies", "_candidate").orderBy(
        "store_ts", "topic", "queue_id", "queue_offset"
    )
    later = F.col("_candidate") & (F.row_number().over(copies) > 1)
    return flagged.withColumn("later", later).drop("_candidate", "_copies")


def record(
    wh: Warehouse, consumed: Sequence[tuple[str, str, str]], now: int, *, policy: CommitPolicy
) -> None:
    """Append (group, key, msg id) of messages consumed now (first of each key only)."""
    seen: set[tuple[str, str]] = set()
    rows = []
    for group, key, msg_id in consumed:
        if key is None or (group, key) in seen:
            continue
        seen.add((group, key))
        rows.append((group, key, msg_id, now))
    if not rows:
        return
    df = wh.engine.spark.createDataFrame(
        rows, "consumer_group string, dedup_key string, msg_id string, first_ts bigint"
    )
    wh.commit(lambda: wh.append("consumed_keys", df), what="consumed_keys", policy=policy)


def prune(
    wh: Warehouse,
    groups: dict[str, GroupConfig],
    now: int,
    *,
    policy: CommitPolicy,
    orphans: bool = False,
) -> int:
    """Delete keys older than their group's window, when there are any (a min() the
    file statistics answer; the DELETE runs about once per window). ``orphans``: also
    every key of a group not among ``groups`` with a dedup key (deleted, or dedup turned
    off) — pass every group then. Returns the rows removed."""
    deduped = {g: cfg for g, cfg in groups.items() if cfg.dedup_key}
    if not deduped and not orphans:
        return 0
    oldest = {
        r["consumer_group"]: r["t"]
        for r in wh.engine.rows(
            f"SELECT consumer_group, min(first_ts) AS t FROM {wh.ref('consumed_keys')} "
            "GROUP BY consumer_group"
        )
    }
    stale = []
    for g, t in sorted(oldest.items()):
        if g in deduped and t is not None and t < now - _window(deduped[g]):
            stale.append(
                f"(consumer_group = {sql_str(g)} AND first_ts < {sql_long(now - _window(deduped[g]))})"
            )
        elif g not in deduped and orphans:
            stale.append(f"consumer_group = {sql_str(g)}")
    if not stale:
        return 0
    cond = " OR ".join(stale)
    n = wh.engine.rows(f"SELECT count(*) AS n FROM {wh.ref('consumed_keys')} WHERE {cond}")[0]["n"]
    statement = f"DELETE FROM {wh.ref('consumed_keys')} WHERE {cond}"
    wh.commit(lambda: wh.engine.execute(statement), what="consumed_keys", policy=policy)
    return n


def _window(cfg: GroupConfig) -> int:
    return int(cfg.dedup_window_ms or DEFAULT_WINDOW_MS)
