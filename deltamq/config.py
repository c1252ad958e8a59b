"""Broker configuration: frozen, validated data; ``DELTAMQ_*`` variables override it.

Example:
    >>> cfg = BrokerConfig(commit_retries=5)
    >>> cfg = BrokerConfig.from_env({"DELTAMQ_COMMIT_RETRIES": "3"})
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from deltamq.arrow_memory import MemoryPool, check_pool
from deltamq.constants import DEFAULT_LEVELS, DEFAULT_QUEUES, MAX_BODY_BYTES
from deltamq.consumer import validate_retry_policy
from deltamq.errors import ConfigError
from deltamq.message import validate_group_name

EngineMode = Literal["embedded", "remote", "classic"]
ENGINE_MODES: tuple[str, ...] = get_args(EngineMode)

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")


def parse_duration_ms(text: str) -> int:
    """``"30s"`` → 30000. Units: ms, s, m, h, d."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ConfigError(
            f"bad duration {text!r}: expected a positive integer with a unit ms, s, m, h or d "
            "(e.g. 500ms, 30s, 2h)"
        )
    value = int(m.group(1)) * _UNIT_MS[m.group(2)]
    if value <= 0:
        raise ConfigError(f"bad duration {text!r}: must be greater than zero")
    return value


TOMBSTONE_RETENTION = "delta.deletedFileRetentionDuration"


def tombstone_retention(config: BrokerConfig) -> str:
    """The ``delta.deletedFileRetentionDuration`` deltamq keeps on its tables: as long as
    the Delta log entries (``log_retention_ms``); see jobs/compact.py."""
    return f"interval {max(1, config.log_retention_ms // 1000)} seconds"


def parse_levels(level_string: str) -> list[tuple[int, int, str]]:
    """Parse RocketMQ's ``messageDelayLevel`` string into (level, delay_ms, label).

    >>> parse_levels("1s 5s")[1]
    (2, 5000, '5s')
    """
    labels = level_string.split()
    if not labels:
        raise ConfigError("the delay level string is empty; expected e.g. '1s 5s 10s 30s 1m'")
    return [(i + 1, parse_duration_ms(lab), lab) for i, lab in enumerate(labels)]


@dataclass(frozen=True)
class CommitPolicy:
    """How a commit that lost a race is retried: at most ``retries`` times, after
    ``backoff_ms`` doubling with each try. Passed with each commit (Engine.commit), as
    delta-rs passes its commit properties with each write. The defaults are
    BrokerConfig's ``commit_retries`` and ``commit_backoff_ms``."""

    retries: int
    backoff_ms: int


# settings the engine and the warehouse are opened with: a broker keeps them for its life
OPEN_TIME_SETTINGS = ("engine", "remote", "storage_options")


MAX_PROMOTE_AHEAD_MS = 60_000
"""The longest ``promote_ahead_ms``: a queue's plain messages may wait behind copies
promoted ahead for up to that long, so it stays short."""

PROMOTE_AHEAD_BY_ENGINE_MS = {"sail": 1_000, "spark": 8_000}
"""``promote_ahead_ms`` when it is not set, by engine flavour: at least a busy tick or two.
Sail's busy tick takes tens of ms; Apache Spark's seconds (each Delta commit ~1 s on two
cores), so with 1 s ahead a timer waited a tick to be promoted and another to be handed
over: lateness p99 13-21 s against 7.6-8.6 s with 8 s ahead (docs/engines.md)."""
_BY_ENGINE = (
    f"None (by the engine: {PROMOTE_AHEAD_BY_ENGINE_MS['sail']} on Sail, "
    f"{PROMOTE_AHEAD_BY_ENGINE_MS['spark']} on Apache Spark)"
)


@dataclass(frozen=True)
class BrokerConfig:
    """Every tunable of the broker. Defaults follow RocketMQ (docs/behaviour.md)."""

    engine: EngineMode = "embedded"
    remote: str | None = None
    delay_levels: str = DEFAULT_LEVELS
    default_queues: int = DEFAULT_QUEUES
    max_body_bytes: int = MAX_BODY_BYTES
    timer_horizon_ms: int = 365 * 86_400_000
    file_reserved_time_ms: int = 72 * 3_600_000
    dlq_reserved_time_ms: int = 7 * 86_400_000
    lease_ttl_ms: int = 60_000
    commit_retries: int = 8
    commit_backoff_ms: int = 50
    dispatch_max_versions: int = 10_000
    orderly_suspend_ms: int = 1000  # SUSPEND_CURRENT_QUEUE_A_MOMENT pause
    # Promote ahead (docs/behaviour.md §2): a promote pass at ``now`` also writes and indexes
    # the copies of what falls due by ``now + promote_ahead_ms``; each copy's index row
    # carries its due time, and no consumer is handed it before then (a queue's readers
    # stop at its first row not yet due). A timer is then in its queue when it falls due
    # and the next deliver or pull hands it over, without waiting for a promote pass.
    # 0: promote only what is due; None: by the engine (PROMOTE_AHEAD_BY_ENGINE_MS, 1 s on
    # Sail, 8 s on Apache Spark), read through Context.promote_ahead_ms.
    promote_ahead_ms: int | None = None
    # docs/behaviour.md §5: check-back pass interval, age before a half message is checked, checks
    # before it is discarded (a half message born more than file_reserved_time_ms ago is
    # discarded too)
    transaction_check_interval_ms: int = 60_000
    transaction_timeout_ms: int = 6_000
    transaction_check_max: int = 15
    # Pull clients (docs/behaviour.md §6): a client silent this long leaves its group; a queue owner
    # silent lock_queue_timeout_ms loses the queue lock; a non-owner may take a fully
    # acked queue after this many of its refused pulls saw the delivered offset unchanged.
    client_timeout_ms: int = 120_000
    lock_queue_timeout_ms: int = 60_000
    max_deliver_offset_no_change_times: int = 3
    # Retention (docs/behaviour.md §8): the retain job runs at most every retain_interval_ms; tick
    # records and data-quality results are kept their own windows.
    retain_interval_ms: int = 3_600_000
    job_runs_reserved_time_ms: int = 7 * 86_400_000
    dq_reserved_time_ms: int = 30 * 86_400_000
    # after each retention pass: compaction, checkpoints, and vacuum of files no version
    # newer than this references (time travel reaches back this far)
    vacuum_retention_ms: int = 24 * 3_600_000
    # Delta log cleanup (every tick's retain step, every log_retention_ms / 2 of wall
    # clock): commit entries older than this (wall clock) below each table's newest
    # checkpoint are deleted (commit_log's only once dispatch has read them). Every tick
    # adds several entries to the hot tables, and reading a table lists its log: without
    # cleanup an idle tick slows as ticks accumulate (bench/README.md). Time travel
    # through delta-rs reaches back this far.
    log_retention_ms: int = 60_000
    compact: bool = True
    # A tick runner that found nothing to do, with nothing falling due, skips the next
    # ticks' jobs while no table the jobs read has a new commit: one look-up per table
    # (the next Delta log entry) instead of a dozen statements (orchestration/tick.py).
    skip_idle_ticks: bool = True
    # Bodies a deliver pass hands to listeners at most, in all, for the groups whose
    # take is automatic (pull_batch_size 0): a backlog is worked off in a few large passes
    # instead of many small ones, with the engine's memory bounded.
    deliver_max_bytes: int = 512 * 1024 * 1024
    # The embedded Sail server keeps memory for every operation it ran until its process
    # ends (docs/engines.md): a tick or pull finding it above this many MiB replaces it
    # first (0: never).
    embedded_max_rss_mb: int = 4096
    # The allocator of a pull client's process (deltamq.lite.PullConsumer and
    # Broker.pull_consumer switch it when created; deltamq/arrow_memory.py): auto =
    # jemalloc unless the process chose its pool; default = leave it; or jemalloc,
    # mimalloc, system by name.
    pull_memory_pool: MemoryPool = "auto"
    # Object-store settings of the warehouse (deltamq/storage.py, docs/storage.md), named
    # like the standard environment variables they override: AWS_REGION,
    # AWS_ENDPOINT_URL, AZURE_STORAGE_ACCOUNT_NAME, GOOGLE_SERVICE_ACCOUNT, ... Kept out
    # of repr (they may hold credentials) and never written to a table.
    storage_options: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def commit_policy(self) -> CommitPolicy:
        return CommitPolicy(self.commit_retries, self.commit_backoff_ms)

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_MODES:
            raise ConfigError(f"engine={self.engine!r} is not allowed; use one of {ENGINE_MODES}")
        if self.remote is not None and not self.remote.startswith("sc://"):
            raise ConfigError(f"remote={self.remote!r} is not a Spark Connect URL (sc://host:port)")
        parse_levels(self.delay_levels)
        for name in (
            "default_queues",
            "max_body_bytes",
            "timer_horizon_ms",
            "file_reserved_time_ms",
            "dlq_reserved_time_ms",
            "lease_ttl_ms",
            "dispatch_max_versions",
            "deliver_max_bytes",
            "orderly_suspend_ms",
            "transaction_check_interval_ms",
            "transaction_timeout_ms",
            "transaction_check_max",
            "client_timeout_ms",
            "lock_queue_timeout_ms",
            "max_deliver_offset_no_change_times",
            "retain_interval_ms",
            "job_runs_reserved_time_ms",
            "dq_reserved_time_ms",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be greater than zero")
        if self.log_retention_ms < 0 or self.vacuum_retention_ms < 0:
            raise ConfigError(
                f"log_retention_ms={self.log_retention_ms!r} and vacuum_retention_ms="
                f"{self.vacuum_retention_ms!r} must be zero or more"
            )
        ahead = self.promote_ahead_ms
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int)):
            raise ConfigError(
                f"promote_ahead_ms={ahead!r} must be an integer of milliseconds, or {_BY_ENGINE}"
            )
        if ahead is not None and not 0 <= ahead <= MAX_PROMOTE_AHEAD_MS:
            raise ConfigError(
                f"promote_ahead_ms={ahead!r} must be between 0 (promote only what is due) and "
                f"{MAX_PROMOTE_AHEAD_MS}, or {_BY_ENGINE}"
            )
        if self.commit_retries < 0 or self.commit_backoff_ms < 0:
            raise ConfigError("commit_retries and commit_backoff_ms must be zero or more")
        if not isinstance(self.storage_options, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | bool) for k, v in self.storage_options.items()
        ):
            raise ConfigError("storage_options must map option names (e.g. 'AWS_REGION') to string values")
        check_pool(self.pull_memory_pool)
        if self.embedded_max_rss_mb < 0:
            raise ConfigError(
                f"embedded_max_rss_mb={self.embedded_max_rss_mb!r} must be zero (never replace "
                "the embedded server) or a size in MiB"
            )

    @property
    def levels(self) -> list[tuple[int, int, str]]:
        return parse_levels(self.delay_levels)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> BrokerConfig:
        """Defaults, then ``overrides``, then ``DELTAMQ_<FIELD>`` environment variables."""
        env = os.environ if env is None else env
        values: dict[str, object] = dict(overrides)
        for f in dataclasses.fields(cls):
            if f.name == "storage_options":
                continue  # the stores' own variables (AWS_*, AZURE_*, GOOGLE_*) apply instead
            raw = env.get("DELTAMQ_" + f.name.upper())
            if raw is None:
                if f.name == "remote" and env.get("DELTAMQ_SPARK_REMOTE"):
                    values["remote"] = env["DELTAMQ_SPARK_REMOTE"]
                continue
            if f.type in ("int", int, "int | None"):
                if f.type == "int | None" and raw.strip().lower() == "auto":
                    values[f.name] = None  # the default: decided by the engine
                    continue
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    also = " or auto" if f.type == "int | None" else ""
                    raise ConfigError(f"DELTAMQ_{f.name.upper()}={raw!r} is not an integer{also}") from None
            elif f.type in ("bool", bool):
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ConfigError(f"DELTAMQ_{f.name.upper()}={raw!r} is not allowed; use true or false")
                values[f.name] = raw.lower() in ("true", "1")
            else:
                values[f.name] = raw
        if values.get("remote") and "engine" not in values:
            values["engine"] = "remote"
        return cls(**values)  # type: ignore[arg-type]


# --- consumer groups and subscriptions ---------------------------------------------------------
MessageModel = Literal["CLUSTERING", "BROADCASTING"]
MESSAGE_MODELS: tuple[str, ...] = get_args(MessageModel)
ConsumeFrom = Literal["LAST_OFFSET", "FIRST_OFFSET", "TIMESTAMP"]
CONSUME_FROM: tuple[str, ...] = get_args(ConsumeFrom)
ExpressionType = Literal["TAG", "SQL92"]
EXPRESSION_TYPES: tuple[str, ...] = get_args(ExpressionType)

_GROUP_INTS = (
    ("pull_batch_size", 0),
    ("consume_batch_size", 1),
    ("consume_timeout_ms", 1),
    ("max_reconsume_times", -1),
    ("invisible_time_ms", 1),
    ("dedup_window_ms", 1),
)


@dataclass(frozen=True)
class GroupConfig:
    """One consumer group's configuration (a ``group_config`` row), validated on
    construction (docs/behaviour.md §3). ``listener`` is the stored import path of its push
    listener (None: a callable registered in this process, or a pull/sink group)."""

    consumer_group: str
    mode: MessageModel = "CLUSTERING"
    orderly: bool = False
    max_reconsume_times: int = 16  # -1: unlimited (the default of an orderly group)
    # messages taken per queue per tick; 0: as many as the pass's byte budget allows
    # (BrokerConfig.deliver_max_bytes), shared evenly between the queues with a backlog
    pull_batch_size: int = 0
    consume_batch_size: int = 1
    consume_from: ConsumeFrom = "LAST_OFFSET"
    consume_timestamp: int | None = None
    consume_timeout_ms: int = 15 * 60_000
    dedup_key: str | None = None
    listener: str | None = None
    retry_policy: Mapping[str, Any] | None = None
    created_ts: int | None = None
    instances: tuple[str, ...] = ()
    invisible_time_ms: int = 60_000
    dedup_window_ms: int = 24 * 3_600_000
    sink_table: str | None = None
    sink_key_columns: tuple[str, ...] = ()
    sink_transform: str | None = None

    def __post_init__(self) -> None:
        validate_group_name(self.consumer_group)
        if self.mode not in MESSAGE_MODELS:
            raise ConfigError(f"mode={self.mode!r} is not allowed; use one of {MESSAGE_MODELS}")
        if self.consume_from not in CONSUME_FROM:
            raise ConfigError(f"consume_from={self.consume_from!r} is not allowed; use one of {CONSUME_FROM}")
        if self.consume_from == "TIMESTAMP" and self.consume_timestamp is None:
            raise ConfigError("consume_from='TIMESTAMP' needs consume_timestamp (epoch ms)")
        if self.consume_timestamp is not None and self.consume_from != "TIMESTAMP":
            raise ConfigError(
                f"consume_timestamp={self.consume_timestamp} is used with consume_from='TIMESTAMP' "
                f"only; consume_from is {self.consume_from!r}"
            )
        if self.instances and self.mode != "BROADCASTING":
            raise ConfigError(
                f"instances={list(self.instances)} are for BROADCASTING groups (each instance gets "
                f"every message); a {self.mode} group shares its queues among its consumers"
            )
        for name, low in _GROUP_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                shown = "consume_message_batch_max_size" if name == "consume_batch_size" else name
                hint = " (0: as many as the tick's budget allows)" if name == "pull_batch_size" else ""
                raise ConfigError(f"{shown}={value!r} is not allowed; it must be an integer >= {low}{hint}")
        object.__setattr__(self, "retry_policy", validate_retry_policy(self.retry_policy))
        object.__setattr__(
            self, "instances", tuple(validate_group_name(i, "instance") for i in self.instances or ())
        )
        object.__setattr__(self, "sink_key_columns", tuple(self.sink_key_columns or ()))
        if self.mode == "BROADCASTING" and self.listener is not None and not self.instances:
            raise ConfigError(
                "a BROADCASTING push group delivers to each of its instances: declare them, "
                "e.g. instances=['host-a', 'host-b']"
            )

    @property
    def name(self) -> str:
        return self.consumer_group

    @property
    def clients(self) -> list[str]:
        """Whose offsets the group keeps: the group's ('') or, BROADCASTING, each instance's."""
        return [""] if self.mode == "CLUSTERING" else list(self.instances)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> GroupConfig:
        """A stored ``group_config`` row (columns added by later schema versions may be NULL)."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        values = {k: row[k] for k in defaults if k in row and row[k] is not None}
        if isinstance(values.get("retry_policy"), str):
            values["retry_policy"] = json.loads(values["retry_policy"])
        # what earlier releases stored beside settings that ignore it: read as before
        if values.get("consume_from", defaults["consume_from"]) != "TIMESTAMP":
            values.pop("consume_timestamp", None)
        if values.get("mode", defaults["mode"]) != "BROADCASTING":
            values.pop("instances", None)
        return cls(**values)


@dataclass(frozen=True)
class Subscription:
    """A group's subscription to a topic: a tag expression or an SQL92 predicate."""

    consumer_group: str
    topic: str
    expr_type: ExpressionType = "TAG"
    expression: str = "*"

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Subscription:
        return cls(row["consumer_group"], row["topic"], row["expr_type"], row["expression"])
