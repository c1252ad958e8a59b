"""Every deltamq table, defined once.

Each table is a :class:`TableSpec`: its ``StructType`` (an UPPER_SNAKE constant),
partition columns and Delta table properties. ``init``, the DDL, the upgrade
path, DQ suites and docs all derive from these objects.

Schema versions: every column and table records the warehouse schema version
that introduced it (``added_in``). A warehouse records the version it was
created or last upgraded at; ``init`` upgrades an older warehouse in place by
creating the tables and adding the columns introduced since (see
``deltamq/tables/warehouse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import types as T

from deltamq.constants import SCHEMA_VERSION  # noqa: E402,F401 - re-exported

# Columns a later schema version adds go at the end of their table, so that an
# upgraded table and a freshly created one have the same column order.


def _f(name: str, dtype: T.DataType, comment: str, *, added_in: int = 1) -> T.StructField:
    return T.StructField(name, dtype, True, {"comment": comment, "added_in": added_in})


STR = T.StringType()
LONG = T.LongType()
INT = T.IntegerType()
BOOL = T.BooleanType()
PROPS = T.MapType(T.StringType(), T.StringType(), True)


@dataclass(frozen=True)
class TableSpec:
    """One table: name, schema, partitioning, properties, the version that added it."""

    name: str
    schema: T.StructType
    partition_by: tuple[str, ...] = ()
    properties: dict[str, str] = field(default_factory=dict)
    added_in: int = 1
    doc: str = ""
    partitioned_in: int = 1
    """The schema version from which the table is partitioned by ``partition_by``; before
    it the table had no partitions (an upgrade across it rewrites the table's rows)."""

    def partitioning_at(self, version: int) -> tuple[str, ...]:
        return self.partition_by if version >= self.partitioned_in else ()

    def columns_at(self, version: int) -> T.StructType:
        """The table's columns as of schema ``version``, without our metadata (Sail's
        Spark Connect schema parser refuses field metadata; comments live in docs)."""
        return T.StructType(
            [
                T.StructField(f.name, f.dataType, True)
                for f in self.schema.fields
                if f.metadata.get("added_in", 1) <= version
            ]
        )

    @property
    def columns(self) -> list[str]:
        return self.schema.fieldNames()

    def ddl_columns(self, version: int = SCHEMA_VERSION) -> str:
        """``col TYPE, ...`` for CREATE TABLE (names are constants, never user text)."""
        return ", ".join(
            f"{f.name} {f.dataType.simpleString().upper()}" for f in self.columns_at(version).fields
        )


COMMIT_LOG = T.StructType(
    [
        _f("msg_id", STR, "unique id; producer ids sort by store time"),
        _f("topic", STR, "topic the message is stored in (system topics included)"),
        _f("queue_id", INT, "queue chosen by the producer"),
        _f("tags", STR, "one tag, may be null"),
        _f("keys", STR, "space separated business keys, may be null"),
        _f("body", T.BinaryType(), "payload, at most 4 MiB"),
        _f("flag", INT, "user flag"),
        _f("properties", PROPS, "user and system properties (docs/behaviour.md §1 keys)"),
        _f("born_ts", LONG, "epoch ms when the producer created it"),
        _f("store_ts", LONG, "epoch ms when it was stored"),
        _f("reconsume_times", INT, "times it was sent back for retry"),
        _f("sys_flag", INT, "RocketMQ MessageSysFlag bits (transaction type)"),
        _f("producer_group", STR, "group of the producer that stored it"),
        _f("batch_id", LONG, "one id per producer commit: (store ms << 20) | random 20 bits"),
        _f("batch_pos", LONG, "position of the row inside its producer commit"),
        _f("store_date", T.DateType(), "UTC date of store_ts; partition column"),
    ]
)

CONSUME_QUEUE = T.StructType(
    [
        _f("topic", STR, "topic; partition column"),
        _f("queue_id", INT, "queue"),
        _f("queue_offset", LONG, "dense per (topic, queue): 0, 1, 2, ..."),
        _f("msg_id", STR, "the commit_log message"),
        _f("tags", STR, "tag of the message"),
        _f("tags_hash", LONG, "xxhash64 of tags, matched before the tag string"),
        _f("keys", STR, "business keys"),
        _f("properties", PROPS, "properties (filters and routing read them here)"),
        _f("store_ts", LONG, "epoch ms the message was stored"),
        _f(
            "due_ts",
            LONG,
            "schedule/timer entries: epoch ms it is due; a copy promote wrote: epoch ms from "
            "which consumers may have it (readers stop at a row not due yet); else null",
        ),
        _f("reconsume_times", INT, "retry count of the message"),
        _f("cl_date", T.DateType(), "commit_log partition holding the body"),
        _f("cl_version", LONG, "commit_log table version that added the row"),
        _f("cl_batch_id", LONG, "commit_log batch_id (body lookups by range)"),
        _f("cl_batch_pos", LONG, "commit_log batch_pos"),
        _f(
            "slot",
            INT,
            "partition within the topic: SCHEDULE_TOPIC_XXXX its queue (one per level), the "
            "timer index the due hour (due_ts DIV 3600000), every other topic 0",
        ),
        _f(
            "born_ts",
            LONG,
            "epoch ms the producer created the message (transaction check ages); null before v3",
            added_in=3,
        ),
    ]
)

TOPIC_CONFIG = T.StructType(
    [
        _f("topic", STR, "topic name"),
        _f("queues", INT, "number of queues"),
        _f("perm", STR, "RW, R, W or DENY"),
        _f("ordered", BOOL, "ordered topic: producers pick queues by key"),
        _f("created_ts", LONG, "epoch ms created"),
        _f("updated_ts", LONG, "epoch ms last changed"),
    ]
)

GROUP_CONFIG = T.StructType(
    [
        _f("consumer_group", STR, "consumer group name"),
        _f("mode", STR, "CLUSTERING or BROADCASTING"),
        _f("orderly", BOOL, "orderly consumption"),
        _f("max_reconsume_times", INT, "retries before the DLQ (-1: unlimited)"),
        _f("pull_batch_size", INT, "messages taken per queue per tick"),
        _f("consume_batch_size", INT, "messages per listener call"),
        _f("consume_from", STR, "LAST_OFFSET, FIRST_OFFSET or TIMESTAMP"),
        _f("consume_timestamp", LONG, "epoch ms, for consume_from TIMESTAMP"),
        _f("consume_timeout_ms", LONG, "listener timeout"),
        _f("dedup_key", STR, "de-duplication key expression, null: off"),
        _f("listener", STR, "listener import path package.module:function"),
        _f("retry_policy", STR, "JSON retry policy, null: RocketMQ's 3 + n levels"),
        _f("created_ts", LONG, "epoch ms created"),
        _f("instances", T.ArrayType(STR), "broadcast instance names", added_in=2),
        _f(
            "invisible_time_ms",
            LONG,
            "pull: ms a pulled message stays invisible before it counts as RECONSUME_LATER",
            added_in=3,
        ),
        _f("dedup_window_ms", LONG, "idempotent consumption: ms a consumed key is remembered", added_in=3),
        _f("sink_table", STR, "exactly-once sink: the Delta table the group MERGEs into", added_in=4),
        _f("sink_key_columns", T.ArrayType(STR), "exactly-once sink: the table's key columns", added_in=4),
        _f("sink_transform", STR, "exactly-once sink: transform import path pkg.module:function", added_in=4),
    ]
)

PRODUCER_CONFIG = T.StructType(
    [
        _f("producer_group", STR, "producer group name", added_in=3),
        _f(
            "check_listener",
            STR,
            "check listener import path package.module:function",
            added_in=3,
        ),
        _f(
            "check_table",
            STR,
            "table check: Delta table (path or name), local state",
            added_in=3,
        ),
        _f("check_key_property", STR, "table check: message property holding the business key", added_in=3),
        _f("check_key_column", STR, "table check: column of check_table matched to that key", added_in=3),
        _f(
            "check_state_expression",
            STR,
            "table check: SQL expression over check_table giving COMMIT, ROLLBACK or UNKNOWN/NULL",
            added_in=3,
        ),
        _f("updated_ts", LONG, "epoch ms of the last change", added_in=3),
    ]
)

SUBSCRIPTION = T.StructType(
    [
        _f("consumer_group", STR, "consumer group"),
        _f("topic", STR, "subscribed topic"),
        _f("expr_type", STR, "TAG or SQL92"),
        _f("expression", STR, "* , TagA || TagB, or an SQL92 predicate"),
        _f("created_ts", LONG, "epoch ms subscribed"),
    ]
)

SCHEDULE_LEVELS = T.StructType(
    [
        _f("level", INT, "delay level 1..N"),
        _f("delay_ms", LONG, "delay of the level in ms"),
        _f("label", STR, "the level as written in the level string, e.g. 30m"),
    ]
)

OFFSETS = T.StructType(
    [
        _f("consumer_group", STR, "consumer group, or a system group such as %DISPATCH%"),
        _f("topic", STR, "topic"),
        _f("queue_id", INT, "queue (-1 for a whole-job progress row)"),
        _f("client_id", STR, "broadcast instance or pull client; '' for the group"),
        _f("next_offset", LONG, "next queue offset to consume"),
        _f("attempts", INT, "orderly: attempts of the message at next_offset"),
        _f("suspend_until", LONG, "orderly: epoch ms the queue is suspended until"),
        _f("progress_version", LONG, "system groups: source table version reached"),
        _f("attempt_ts", LONG, "now of the delivery attempt in flight (attempts > 0): ids of its sends-back"),
        _f("suspends", INT, "orderly: times the message at next_offset was suspended (its retry count)"),
        _f("updated_ts", LONG, "epoch ms (the tick's now) of the last change"),
        _f(
            "delivered_offset",
            LONG,
            "pull groups: next offset to hand out; [next_offset, delivered_offset) is in flight",
            added_in=3,
        ),
    ]
)

DELIVERIES = T.StructType(
    [
        _f("consumer_group", STR, "consumer group"),
        _f("client_id", STR, "pull client"),
        _f("topic", STR, "topic"),
        _f("queue_id", INT, "queue"),
        _f("queue_offset", LONG, "offset delivered"),
        _f("msg_id", STR, "message delivered"),
        _f("receipt_handle", STR, "handle for ack/nack"),
        _f("delivered_ts", LONG, "epoch ms delivered"),
        _f("invisible_until", LONG, "epoch ms after which it counts as RECONSUME_LATER"),
        _f("state", STR, "INFLIGHT, ACKED, NACKED, EXPIRED"),
    ]
)

LEASES = T.StructType(
    [
        _f("job", STR, "job kind"),
        _f("holder", STR, "holder id (host:pid:random)"),
        _f("epoch", LONG, "incremented at every change of holder; fences stale holders"),
        _f("expires_at", LONG, "wall-clock epoch ms the lease expires"),
        _f("acquired_at", LONG, "wall-clock epoch ms the holder took it"),
        _f("last_now", LONG, "the holder's latest tick now (fake or real clock), epoch ms"),
        _f("ttl_ms", LONG, "the holder's lease time; another takes over only after it", added_in=5),
    ]
)

QUEUE_LOCK = T.StructType(
    [
        _f("consumer_group", STR, "consumer group"),
        _f("topic", STR, "topic"),
        _f("queue_id", INT, "queue"),
        _f("owner", STR, "client id holding the queue"),
        _f("last_access_ts", LONG, "epoch ms of the owner's last pull"),
        _f("last_delivered_offset", LONG, "delivered offset last seen"),
        _f("no_change_count", INT, "refused polls with an unchanged delivered offset"),
        _f(
            "delivered_offset",
            LONG,
            "the queue's delivered offset: the end of the owner's last reserved range (changed only "
            "together with the owner, so a takeover never misses a range being handed out)",
            added_in=3,
        ),
    ]
)

CLIENTS = T.StructType(
    [
        _f("consumer_group", STR, "consumer group", added_in=3),
        _f("client_id", STR, "pull client", added_in=3),
        _f("first_seen_ts", LONG, "epoch ms of the client's first pull", added_in=3),
        _f("last_seen_ts", LONG, "epoch ms of its last pull or ack (liveness)", added_in=3),
    ]
)

CONSUMED_KEYS = T.StructType(
    [
        _f("consumer_group", STR, "consumer group"),
        _f("dedup_key", STR, "de-duplication key value"),
        _f("msg_id", STR, "message consumed first with that key"),
        _f("first_ts", LONG, "epoch ms of the first success"),
    ]
)

JOB_RUNS = T.StructType(
    [
        _f("tick_id", STR, "id of the tick (one append per tick)"),
        _f("now_ts", LONG, "the tick's now, epoch ms"),
        _f("job", STR, "job name"),
        _f("start_ts", LONG, "wall-clock epoch ms the job started"),
        _f("end_ts", LONG, "wall-clock epoch ms the job ended"),
        _f("rows_in", LONG, "rows the job read"),
        _f("rows_out", LONG, "rows the job wrote"),
        _f("status", STR, "OK, SKIPPED or FAILED"),
        _f("error", STR, "error text of a failed job"),
        _f("holder", STR, "runner that executed the tick"),
        _f("run_date", T.DateType(), "UTC date of now_ts; partition column"),
        _f("details", T.MapType(STR, LONG), "per-outcome counts", added_in=2),
    ]
)

DQ_RESULTS = T.StructType(
    [
        _f("run_id", STR, "data-quality run id"),
        _f("run_ts", LONG, "epoch ms of the run"),
        _f("suite", STR, "suite (table) checked"),
        _f("expectation", STR, "expectation name"),
        _f("success", BOOL, "passed"),
        _f("observed", STR, "observed value or unexpected ids"),
        _f("unexpected_count", LONG, "rows that failed the expectation", added_in=4),
        _f("sample_ids", T.ArrayType(STR), "up to 20 of the failing rows' ids", added_in=4),
    ]
)

WAREHOUSE_META = T.StructType(
    [
        _f("key", STR, "setting name, e.g. schema_version"),
        _f("value", STR, "setting value"),
        _f("updated_ts", LONG, "wall-clock epoch ms of the change"),
    ]
)

_APPEND_ONLY = {"delta.appendOnly": "false", "delta.enableDeletionVectors": "false"}

TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in [
        TableSpec("warehouse_meta", WAREHOUSE_META, doc="schema version and warehouse settings"),
        TableSpec("topic_config", TOPIC_CONFIG, doc="topics: queue count, permission, order flag"),
        TableSpec("group_config", GROUP_CONFIG, doc="consumer groups and their settings"),
        TableSpec(
            "producer_config",
            PRODUCER_CONFIG,
            added_in=3,
            doc="producer groups: transaction check listener or table check",
        ),
        TableSpec("subscription", SUBSCRIPTION, doc="group -> topic subscriptions"),
        TableSpec("schedule_levels", SCHEDULE_LEVELS, doc="delay level -> delay"),
        TableSpec(
            "commit_log",
            COMMIT_LOG,
            ("store_date",),
            _APPEND_ONLY,
            doc="every stored message, system topics included; blind appends only",
        ),
        TableSpec(
            "consume_queue",
            CONSUME_QUEUE,
            ("topic", "slot"),
            doc="per (topic, queue) dense offsets -> messages; held timers by due hour",
        ),
        TableSpec("offsets", OFFSETS, doc="group offsets and system job progress"),
        TableSpec("deliveries", DELIVERIES, doc="in-flight pull deliveries"),
        TableSpec("leases", LEASES, doc="one holder per job kind"),
        TableSpec(
            "queue_lock",
            QUEUE_LOCK,
            ("consumer_group", "topic", "queue_id"),
            doc="DeFiBus queue access lock; a partition per lock row, so compare-and-sets of "
            "different queues touch different files (Apache Spark's conflict check)",
            partitioned_in=7,
        ),
        TableSpec("clients", CLIENTS, added_in=3, doc="pull clients of each group and when last seen"),
        TableSpec("consumed_keys", CONSUMED_KEYS, doc="dedup keys consumed per group"),
        TableSpec("job_runs", JOB_RUNS, ("run_date",), doc="one append per tick"),
        TableSpec("dq_results", DQ_RESULTS, added_in=2, doc="data-quality results"),
    ]
}


def spec(name: str) -> TableSpec:
    """The spec of table ``name``; KeyError names the known tables."""
    try:
        return TABLES[name]
    except KeyError:
        raise KeyError(f"unknown table {name!r}; known tables: {', '.join(TABLES)}") from None
