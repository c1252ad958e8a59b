"""Exactly-once Delta sinks: a consumer group that MERGEs its messages into a Delta table.

``ctx.sink_to_table(group, table_path, key_columns, transform=None)`` makes ``group``
(a CLUSTERING group with no listener and no pull clients) a sink; the tick's ``sink``
job (or ``sink.run()``) then, per pass and per subscribed queue, takes the messages
from the group's offset on (at most ``pull_batch_size``, 10 000 when it is 0), keeps those matching the
subscription, applies ``transform`` (a DataFrame → DataFrame function), and MERGEs the
result into the table on ``key_columns`` in one commit; the group's offsets move after.

**Exactly once.** Every row written carries ``_deltamq_order``: a text that orders the
messages totally (store time, then topic, queue and offset) and is derived only from the
message. The MERGE updates a key's row only with a row of a strictly later message and
inserts keys it has not seen. A pass killed after its MERGE and before its offsets is
replayed from the same offsets: each replayed row meets its own earlier copy (or a later
message's row) and changes nothing. So after any crash and replay a key's row is the one
of the latest message with that key, written once — RocketMQ's duplicates after restarts
(apache/rocketmq#7182) cannot multiply here. Within one batch, the latest row per key
wins. The transform must be deterministic and keep ``_deltamq_order`` (select ``"*"`` or
the column by name); it may drop messages (``where``) or rename fields.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from deltamq import faults
from deltamq.catalog import listener_path
from deltamq.config import GroupConfig, Subscription
from deltamq.constants import Prop
from deltamq.errors import ConfigError, DeltaMQError, ListenerUnavailable, UnknownGroup, first_line
from deltamq.filters import subscriptions_filter
from deltamq.jobs import deliver_plan
from deltamq.message import validate_group_name
from deltamq.storage import normalize_location
from deltamq.tables.bodies import join_bodies, read_bodies
from deltamq.tables.consume_queue import visible_heads
from deltamq.tables.offsets import advance_offsets, positions
from deltamq.tables.ranges import queue_ranges

if TYPE_CHECKING:
    from deltamq.context import Context

log = logging.getLogger(__name__)

ORDER = "_deltamq_order"
"""Column of every sink row: the total order of the message that wrote it."""

MESSAGE_SCHEMA = T.StructType(
    [
        T.StructField("msg_id", T.StringType()),
        T.StructField("topic", T.StringType()),
        T.StructField("queue_id", T.IntegerType()),
        T.StructField("queue_offset", T.LongType()),
        T.StructField("tags", T.StringType()),
        T.StructField("keys", T.StringType()),
        T.StructField("body", T.BinaryType()),
        T.StructField("properties", T.MapType(T.StringType(), T.StringType())),
        T.StructField("born_ts", T.LongType()),
        T.StructField("store_ts", T.LongType()),
        T.StructField(ORDER, T.StringType()),
    ]
)
"""The DataFrame a transform receives (one row per message)."""

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SinkError(DeltaMQError):
    """A sink pass failed (its transform raised or its output does not fit the table);
    nothing of the pass is committed and the group's offsets stay where they were."""


@dataclass(frozen=True)
class SinkConfig:
    group: str
    table: str
    key_columns: tuple[str, ...]
    transform: str | None  # import path; None: identity or an in-process callable


@dataclass(frozen=True, kw_only=True)
class SinkResult:
    group: str
    messages: int = 0  # matching messages merged (replays included)
    queues: int = 0
    # its transform could not be loaded, or its pass failed: nothing merged, offsets kept
    setup_error: str | None = None


# --- configuration --------------------------------------------------------------------------
def validate_table_path(ctx: Context, table: Any) -> str:
    """The sink table's location, normalized like a warehouse's (deltamq/storage.py); a
    path inside the warehouse (one of its own tables, however spelled) is refused."""
    if not isinstance(table, str) or not (table.startswith(("/", "file:")) or "://" in table):
        raise ConfigError(f"table_path={table!r} must be an absolute path or a URI of a Delta table")
    canonical = normalize_location(table)
    home = ctx.warehouse.location.rstrip("/")
    if canonical == home or canonical.startswith(home + "/"):
        raise ConfigError(
            f"table_path={table!r} is inside the warehouse {home}, among the warehouse's own "
            "tables; choose a path outside it"
        )
    return canonical


def validate_keys(key_columns: Any) -> tuple[str, ...]:
    if isinstance(key_columns, str):
        key_columns = [key_columns]
    if not isinstance(key_columns, Sequence) or not key_columns:
        raise ConfigError(f"key_columns={key_columns!r} must be a non-empty list of column names")
    out = []
    for k in key_columns:
        if not isinstance(k, str) or not _IDENT.match(k) or k.startswith("_deltamq"):
            raise ConfigError(
                f"key column {k!r} is not allowed; use letters, digits and _ (not starting with a digit "
                "or _deltamq)"
            )
        if k in out:
            raise ConfigError(f"key column {k!r} is given twice")
        out.append(k)
    return tuple(out)


def load_transform(ctx: Context, cfg: SinkConfig) -> Callable[[DataFrame], DataFrame] | None:
    fn = ctx.catalog.sink_transforms.get(cfg.group)
    if fn is not None or cfg.transform is None:
        return fn
    from deltamq.consumer import resolve_listener

    resolved = resolve_listener(cfg.transform, f"transform of sink {cfg.group!r}")
    return cast("Callable[[DataFrame], DataFrame]", resolved)


def configs(ctx: Context, groups: dict[str, GroupConfig] | None = None) -> dict[str, SinkConfig]:
    groups = ctx.catalog.groups() if groups is None else groups
    return {
        g: SinkConfig(g, c.sink_table, tuple(c.sink_key_columns or ()), c.sink_transform)
        for g, c in groups.items()
        if c.sink_table
    }


def check_group(ctx: Context, group: str) -> GroupConfig:
    cfg = ctx.catalog.groups().get(group)
    if cfg is None:
        raise UnknownGroup(f"consumer group {group!r} does not exist; create it first")
    if cfg.mode != "CLUSTERING":
        raise ConfigError(f"group {group!r} is {cfg.mode}; a sink consumes a CLUSTERING group")
    if cfg.listener or group in ctx.catalog.listeners:
        raise ConfigError(
            f"group {group!r} has a push listener; a sink needs a group of its own (create one without "
            "a listener)"
        )
    from deltamq.pull_engine import live_clients

    # a client silent past the client timeout has left (docs/behaviour.md §6)
    live = live_clients(ctx, group, ctx.clock.now_ms() - ctx.config.client_timeout_ms)
    if live:
        raise ConfigError(
            f"group {group!r} has live pull clients ({', '.join(live)}); a sink needs a group of its own "
            "(or close those clients first)"
        )
    return cfg


def output(
    ctx: Context, cfg: SinkConfig, messages: DataFrame, transform: Callable[[DataFrame], DataFrame] | None
) -> DataFrame:
    """The transform's rows, checked: key columns and ``_deltamq_order`` present, the latest
    row per key only."""
    try:
        out = transform(messages) if transform is not None else messages
    except Exception as e:  # noqa: BLE001 - any failure of user code
        raise SinkError(f"sink of {cfg.group!r}: the transform raised {type(e).__name__}: {e}") from e
    if not isinstance(out, DataFrame):
        raise SinkError(f"sink of {cfg.group!r}: the transform returned {type(out).__name__}, no DataFrame")
    columns = out.columns
    missing = [c for c in (*cfg.key_columns, ORDER) if c not in columns]
    if missing:
        raise SinkError(
            f"sink of {cfg.group!r}: the transform's output lacks {missing}; it has {columns} "
            f"(keep {ORDER!r}: it guards replays)"
        )
    latest = Window.partitionBy(*[F.col(k) for k in cfg.key_columns]).orderBy(F.col(ORDER).desc())
    return (
        out.withColumn("_deltamq_rank", F.row_number().over(latest))
        .where("_deltamq_rank = 1")
        .drop("_deltamq_rank")
    )


# a value of a type the transform gives (the key) is written without loss into a column
# of any of the types listed for it (Delta's writers cast those); other pairs are refused
_WIDER: dict[str, frozenset[str]] = {
    "tinyint": frozenset({"smallint", "int", "bigint", "float", "double"}),
    "smallint": frozenset({"int", "bigint", "float", "double"}),
    "int": frozenset({"bigint", "double"}),
    "bigint": frozenset(),
    "float": frozenset({"double"}),
    "date": frozenset({"timestamp"}),
}


def _takes(wanted: T.DataType, given: T.DataType) -> bool:
    """Whether a column of type ``wanted`` takes values of type ``given`` without loss."""
    if isinstance(wanted, T.DecimalType) and isinstance(given, T.DecimalType):
        digits = wanted.precision - wanted.scale >= given.precision - given.scale
        return wanted.scale >= given.scale and digits
    have, want = given.simpleString(), wanted.simpleString()  # nullability aside
    return have == want or want in _WIDER.get(have, frozenset())


def _unfit_columns(existing: T.StructType, out: T.StructType) -> list[str]:
    """The columns ``out`` gives in a type the table's column of that name does not take
    without loss, each as ``name: given → table's``."""
    table = {f.name: f.dataType for f in existing.fields}
    return [
        f"{f.name}: {f.dataType.simpleString()} → {table[f.name].simpleString()}"
        for f in out.fields
        if f.name in table and not _takes(table[f.name], f.dataType)
    ]


def check_table(ctx: Context, cfg: SinkConfig, out: DataFrame) -> bool:
    """True if the sink table exists with the output's columns, of types it takes; False if
    it does not exist; SinkError if it has other columns, or a column the output gives in a
    type that would not be written without loss (a string for a bigint: Sail fails the
    pass, Apache Spark may write nulls)."""
    try:
        found = ctx.engine.spark.read.format("delta").load(ctx.warehouse.engine_path(cfg.table)).schema
    except Exception as e:  # noqa: BLE001 - engines word "not a Delta table" differently
        sink_storage = ctx.warehouse.storage.at(cfg.table)
        if not sink_storage.is_delta_table(sink_storage.location):
            return False
        raise SinkError(f"sink of {cfg.group!r}: {cfg.table} is not readable as a Delta table: {e}") from e
    existing = found.fieldNames()
    if sorted(existing) != sorted(out.columns):
        raise SinkError(
            f"sink of {cfg.group!r}: table {cfg.table} has columns {existing}; the transform gives "
            f"{out.columns}"
        )
    unfit = _unfit_columns(found, out.schema)
    if unfit:
        raise SinkError(
            f"sink of {cfg.group!r}: the transform gives columns in types table {cfg.table} does not "
            f"take ({'; '.join(unfit)}); cast them in the transform, or sink into a table of those types"
        )
    return True


def ensure_table(ctx: Context, cfg: SinkConfig, out: DataFrame) -> None:
    """Check the sink table against ``out``'s columns; create it empty if missing."""
    if not check_table(ctx, cfg, out):
        ctx.commit(
            lambda: (
                out.limit(0).write.format("delta").mode("append").save(ctx.warehouse.engine_path(cfg.table))
            ),
            what="sink",
        )


# --- the pass -------------------------------------------------------------------------------
def order_column() -> F.Column:
    return F.concat(
        F.lpad(F.hex(F.col("store_ts")), 16, "0"),
        F.col("topic"),
        F.lpad(F.hex(F.col("queue_id")), 8, "0"),
        F.lpad(F.hex(F.col("queue_offset")), 16, "0"),
    )


def run(
    ctx: Context, now: int, *, fence: Callable[[], None] | None = None, only: str | None = None
) -> list[SinkResult]:
    """One pass of every sink (or of group ``only``)."""
    groups = ctx.catalog.groups()
    sinks = configs(ctx, groups)
    if only is not None:
        if only not in sinks:
            raise ConfigError(f"group {only!r} is not a sink; sinks are {sorted(sinks)}")
        sinks = {only: sinks[only]}
    if not sinks:
        return []
    heads = visible_heads(ctx.warehouse, now)
    offsets = positions(ctx.warehouse, sorted(sinks))
    subs = [s for s in ctx.catalog.subscriptions() if s.consumer_group in sinks]
    takes = deliver_plan.plan_takes({g: groups[g] for g in sinks}, subs, heads, offsets, now)
    results = []
    for group, cfg in sorted(sinks.items()):
        mine = [t for t in takes if t.group == group]
        if mine:
            try:  # a transform that cannot be loaded stops its own sink, as a listener does
                transform = load_transform(ctx, cfg)
            except ListenerUnavailable as e:
                if only is not None:  # Sink.run(): the caller asked for this sink
                    raise
                log.warning("sink %r took nothing: %s", group, e)
                results.append(SinkResult(group=group, setup_error=str(e)))
                continue
            if fence:
                fence()
            try:
                results.append(_pass(ctx, cfg, mine, now, subs, transform))
            except Exception as e:  # noqa: BLE001 - this sink's data or table; deltamq's own faults go up
                if only is not None or (isinstance(e, DeltaMQError) and not isinstance(e, SinkError)):
                    raise
                # a transform failing on these rows, a table that no longer fits: this sink
                # waits (nothing merged, its offsets kept) and the others go on, as a group
                # whose listener cannot be loaded does; the tick names it (exit 4)
                why = f"sink pass into {cfg.table} failed: {type(e).__name__}: {first_line(e)[:500]}"
                log.warning("sink %r took nothing: %s", group, why)
                results.append(SinkResult(group=group, setup_error=why))
    return results


def _pass(
    ctx: Context,
    cfg: SinkConfig,
    takes: list[deliver_plan.QueueTake],
    now: int,
    subs: list[Subscription],
    transform: Callable[[DataFrame], DataFrame] | None,
) -> SinkResult:
    wh = ctx.warehouse
    pred = queue_ranges((t.topic, t.queue_id, t.lo, t.hi) for t in takes)
    matches = subscriptions_filter(s for s in subs if s.consumer_group == cfg.group)
    cq = wh.read("consume_queue").where(pred).where(matches)
    index = cq.select("cl_date", "cl_batch_id").groupBy("cl_date", "cl_batch_id").count().collect()
    n = sum(r["count"] for r in index)
    if n:
        bodies = read_bodies(wh, (r["cl_date"] for r in index), (r["cl_batch_id"] for r in index))
        rows = join_bodies(cq.drop("properties", "born_ts"), bodies, ["body", "born_ts", "properties"])
        derived = {
            "msg_id": F.coalesce(F.col("properties").getItem(Prop.UNIQ_KEY), F.col("msg_id")),
            ORDER: order_column(),
        }
        messages = rows.select(
            *[derived.get(f.name, F.col(f.name)).cast(f.dataType).alias(f.name) for f in MESSAGE_SCHEMA]
        )
        out = output(ctx, cfg, messages, transform)
        merge(ctx, cfg, out)
    faults.point("sink.after_merge_commit")
    ctx.commit(
        lambda: advance_offsets(wh, cfg.group, [(t.topic, t.queue_id, t.hi, None) for t in takes], now),
        what="offsets",
    )
    faults.point("sink.after_offsets_commit")
    return SinkResult(group=cfg.group, messages=n, queues=len(takes))


def merge(ctx: Context, cfg: SinkConfig, out: DataFrame) -> None:
    """Upsert ``out`` into the sink table on the keys, a key's row replaced only by a row
    of a later message (the replay guard). Creates the table on first use."""
    engine = ctx.engine
    ensure_table(ctx, cfg, out)
    on = " AND ".join(f"t.`{k}` <=> s.`{k}`" for k in cfg.key_columns)
    target = "delta.`" + ctx.warehouse.engine_path(cfg.table).replace("`", "``") + "`"
    with engine.views() as views:
        view = views.add(out, "sink")
        statement = (
            f"MERGE INTO {target} t USING {view} s ON {on} "
            f"WHEN MATCHED AND s.{ORDER} > t.{ORDER} THEN UPDATE SET * "
            "WHEN NOT MATCHED THEN INSERT *"
        )
        faults.point("sink.before_merge_commit")
        ctx.commit(lambda: engine.execute(statement), what="sink")


class Sink:
    """Handle of a sink group: ``run()`` a pass now (the tick's ``sink`` job runs them too)."""

    def __init__(self, ctx: Context, group: str) -> None:
        self.ctx, self.group = ctx, group

    @property
    def config(self) -> SinkConfig:
        return configs(self.ctx)[self.group]

    def run(self, now: int | None = None) -> SinkResult:
        now = self.ctx.clock.now_ms() if now is None else int(now)
        results = run(self.ctx, now, only=self.group)
        return results[0] if results else SinkResult(group=self.group)

    def read(self) -> DataFrame:
        """The sink table."""
        return self.ctx.engine.spark.read.format("delta").load(
            self.ctx.warehouse.engine_path(self.config.table)
        )


def configure(
    ctx: Context,
    group: str,
    table_path: str,
    key_columns: str | list[str],
    transform: Callable[..., Any] | str | None = None,
) -> Sink:
    """Make ``group`` an exactly-once sink into the Delta table at ``table_path`` (see
    ``Broker.sink_to_table``): the table and the transform are checked now, on an empty
    batch, and a missing table is created."""
    group = validate_group_name(group)
    table = validate_table_path(ctx, table_path)
    keys = validate_keys(key_columns)
    check_group(ctx, group)
    registry: dict[str, Callable[..., Any]] = {}
    path = listener_path(registry, group, transform, f"transform of sink {group!r}")
    cfg = SinkConfig(group, table, keys, path)
    fn = registry.get(group) or (load_transform(ctx, cfg) if path else None)
    # the transform and the table are checked now, on an empty batch
    empty = ctx.engine.spark.createDataFrame([], MESSAGE_SCHEMA)
    ensure_table(ctx, cfg, output(ctx, cfg, empty, fn))
    if registry:
        ctx.catalog.sink_transforms[group] = registry[group]
    else:
        ctx.catalog.sink_transforms.pop(group, None)
    ctx.catalog.set_sink(group, table, keys, path)
    return Sink(ctx, group)
