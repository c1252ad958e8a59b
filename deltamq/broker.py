"""``deltamq.Broker``: open a warehouse, administer it, produce, and tick.

Example:
    >>> from deltamq import Broker, Message, FakeClock
    >>> broker = Broker.open("/tmp/wh", clock=FakeClock())
    >>> broker.create_topic("orders", queues=4)
    >>> broker.producer("shop").send(Message("orders", b"hello"))
    >>> broker.sql("SELECT topic, count(*) FROM commit_log GROUP BY topic").show()
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from deltamq.clock import Clock, SystemClock
from deltamq.config import BrokerConfig
from deltamq.constants import DLQ_PREFIX, MAX_QUEUES, Perm, dlq_topic, is_system_topic, retry_topic
from deltamq.engine import Engine
from deltamq.errors import (
    AlreadyExists,
    ConfigError,
    DeltaMQError,
    SystemTopicError,
    UnknownGroup,
    UnknownTopic,
)
from deltamq.message import validate_group_name, validate_topic_name
from deltamq.producer import Producer
from deltamq.sending import Topics
from deltamq.tables.sqlguard import check_read_only
from deltamq.tables.sqltext import USER_GROUPS, sql_bool, sql_int, sql_long, sql_str
from deltamq.tables.warehouse import Warehouse

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

ConsumeFrom = Literal["LAST_OFFSET", "FIRST_OFFSET", "TIMESTAMP"]
CONSUME_FROM = ("LAST_OFFSET", "FIRST_OFFSET", "TIMESTAMP")
MessageModel = Literal["CLUSTERING", "BROADCASTING"]
MESSAGE_MODELS = ("CLUSTERING", "BROADCASTING")


class Broker(Topics):
    """One warehouse of deltamq tables and the engine that works on them."""

    def __init__(self, engine: Engine, warehouse: Warehouse, clock: Clock, config: BrokerConfig) -> None:
        self.engine = engine
        self.warehouse = warehouse
        self.clock = clock
        self.config = config
        super().__init__()
        self._max_level: int | None = None
        self.listeners: dict[str, Callable[..., Any]] = {}
        self.check_listeners: dict[str, Callable[..., Any]] = {}
        self.sink_transforms: dict[str, Callable[..., Any]] = {}
        self._runner = None
        self._retain_last: int | None = None  # the retain job's last pass (see jobs/retain.py)
        self._log_cleanup_wall: float | None = None  # the last Delta log cleanup (jobs/compact.py)

    # --- opening ---------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        warehouse: str | os.PathLike[str],
        *,
        remote: str | None = None,
        spark: SparkSession | None = None,
        clock: Clock | None = None,
        config: BrokerConfig | None = None,
        create: bool = True,
        levels: str | None = None,
    ) -> Broker:
        """Open (and by default create) the warehouse at ``warehouse``.

        ``remote`` is a Spark Connect URL; ``spark`` an existing session (classic or
        Connect); neither means the embedded Sail engine. ``clock`` defaults to the
        system clock. A new warehouse is initialised; an existing one must be at this
        release's schema version (``deltamq init`` upgrades older ones).
        """
        if config is None:
            config = BrokerConfig.from_env(None, **({"remote": remote} if remote else {}))
        elif remote:
            config = BrokerConfig(**{**config.__dict__, "remote": remote, "engine": "remote"})
        engine = Engine.open(config, spark=spark)
        wh = Warehouse(engine, warehouse)
        broker = cls(engine, wh, clock or SystemClock(), config)
        if create and wh.schema_version() is None:
            wh.init(levels)
        wh.ensure_ready()
        return broker

    def close(self) -> None:
        """Release this broker's leases and stop its Spark session (the embedded
        server stays up for other brokers of the process)."""
        if self._runner is not None:
            self._runner.release()
            self._runner = None
        self.engine.close()

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Broker({self.warehouse.location!r}, engine={self.engine.mode})"

    # --- SQL -------------------------------------------------------------------------------
    def sql(self, query: str, *, write: bool = False) -> DataFrame:
        """Run SQL with every table registered as a view under its own name.

        Read-only unless ``write=True`` (then DML on ``delta.`path``` works too).
        """
        if not write:
            check_read_only(query)
        # Re-registered on every call: Sail resolves a temp view's Delta snapshot when the
        # view is created, so a view made earlier would not see later commits.
        self.warehouse.register_views()
        return self.engine.sql(query)

    def table(self, name: str) -> DataFrame:
        """A table as a DataFrame."""
        return self.warehouse.read(name)

    # --- topics ----------------------------------------------------------------------------
    def _topic_rows(self) -> list[tuple[str, int, str, bool]]:
        rows = self.engine.rows(
            f"SELECT topic, queues, perm, ordered FROM {self.warehouse.ref('topic_config')}"
        )
        return [(r["topic"], r["queues"], r["perm"], r["ordered"]) for r in rows]

    def create_topic(
        self,
        name: str,
        queues: int | None = None,
        perm: str = "RW",
        *,
        ordered: bool = False,
        exist_ok: bool = False,
    ) -> None:
        """Create a topic with ``queues`` queues (default 4) and a permission (RW/R/W/DENY)."""
        validate_topic_name(name)
        self._upsert_topic(
            name,
            self.config.default_queues if queues is None else queues,
            perm,
            ordered,
            create=True,
            exist_ok=exist_ok,
        )

    def update_topic(
        self, name: str, *, queues: int | None = None, perm: str | None = None, ordered: bool | None = None
    ) -> None:
        """Change a topic's queue count, permission or order flag."""
        validate_topic_name(name)
        info = self._topic(name)
        if info is None:
            raise UnknownTopic(f"topic {name!r} does not exist")
        self._upsert_topic(
            name,
            info[0] if queues is None else queues,
            info[1] if perm is None else perm,
            info[2] if ordered is None else ordered,
            create=False,
        )

    def _create_system_topic(self, name: str, queues: int) -> None:
        validate_topic_name(name, allow_system=True)
        if self._topic(name) is None:
            self._upsert_topic(name, queues, "RW", False, create=True, exist_ok=True)

    def _upsert_topic(
        self, name: str, queues: int, perm: str, ordered: bool, *, create: bool, exist_ok: bool = False
    ) -> None:
        if isinstance(queues, bool) or not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
            raise ConfigError(f"queues={queues!r} is not allowed; a topic has 1..{MAX_QUEUES} queues")
        try:
            perm = Perm(perm).value
        except ValueError:
            raise ConfigError(f"perm={perm!r} is not allowed; use one of {[p.value for p in Perm]}") from None
        if create:
            existing = self._topic(name)
            if existing is not None:
                if exist_ok:
                    return
                raise AlreadyExists(f"topic {name!r} already exists ({existing[0]} queues, {existing[1]})")
        now = self.clock.now_ms()
        statement = (
            f"MERGE INTO {self.warehouse.ref('topic_config')} t USING (SELECT {sql_str(name)} AS topic, "
            f"{sql_int(queues)} AS queues, {sql_str(perm)} AS perm, {sql_bool(ordered)} AS ordered, "
            f"{sql_long(now)} AS ts) s ON t.topic = s.topic "
            "WHEN MATCHED THEN UPDATE SET t.queues = s.queues, t.perm = s.perm, t.ordered = s.ordered, "
            "t.updated_ts = s.ts "
            "WHEN NOT MATCHED THEN INSERT (topic, queues, perm, ordered, created_ts, updated_ts) "
            "VALUES (s.topic, s.queues, s.perm, s.ordered, s.ts, s.ts)"
        )
        self.engine.commit(lambda: self.engine.execute(statement), what="topic_config")
        self._load_topics()

    def delete_topic(self, name: str) -> None:
        """Delete a topic's configuration and its subscriptions. Stored messages stay
        until retention removes them (docs/behaviour.md §8); producers are refused at once."""
        validate_topic_name(name)
        if self._topic(name) is None:
            raise UnknownTopic(f"topic {name!r} does not exist")
        t = sql_str(name)
        self.engine.commit(
            lambda: self.engine.execute(
                f"DELETE FROM {self.warehouse.ref('subscription')} WHERE topic = {t}"
            ),
            what="subscription",
        )
        self.engine.commit(
            lambda: self.engine.execute(
                f"DELETE FROM {self.warehouse.ref('topic_config')} WHERE topic = {t}"
            ),
            what="topic_config",
        )
        self._load_topics()

    # --- groups ----------------------------------------------------------------------------
    def groups(self) -> dict[str, dict[str, Any]]:
        rows = self.engine.rows(f"SELECT * FROM {self.warehouse.ref('group_config')} ORDER BY consumer_group")
        return {r["consumer_group"]: r.asDict() for r in rows}

    def _group_exists(self, name: str) -> bool:
        return bool(
            self.engine.rows(
                f"SELECT 1 FROM {self.warehouse.ref('group_config')} WHERE consumer_group = {sql_str(name)}"
            )
        )

    def create_group(
        self,
        name: str,
        listener: Callable[..., Any] | str | None = None,
        *,
        mode: MessageModel = "CLUSTERING",
        orderly: bool = False,
        max_reconsume_times: int | None = None,
        pull_batch_size: int = 10_000,
        consume_message_batch_max_size: int = 1,
        consume_from: ConsumeFrom = "LAST_OFFSET",
        consume_timestamp: int | None = None,
        consume_timeout_ms: int = 15 * 60_000,
        consume_timeout: timedelta | None = None,
        dedup_key: str | None = None,
        retry_policy: dict[str, Any] | None = None,
        instances: list[str] | None = None,
        invisible_time_ms: int = 60_000,
        dedup_window_ms: int = 24 * 3_600_000,
        exist_ok: bool = False,
    ) -> None:
        """Create a consumer group (docs/behaviour.md §3).

        ``listener`` is a callable or an import path ``"package.module:function"``; the
        path is stored in ``group_config`` so jobs started by Airflow or spark-submit
        find it. A CLUSTERING group is subscribed to its own ``%RETRY%<group>``.
        ``invisible_time_ms``: pull consumers — a pulled message not acked within it counts
        as RECONSUME_LATER. ``dedup_key`` (``UNIQ_KEY``, ``KEYS`` or an SQL expression over
        the consume_queue row): a message whose key the group consumed successfully within
        ``dedup_window_ms`` is acknowledged without reaching the listener (docs/behaviour.md §7).
        """
        validate_group_name(name)
        if mode not in MESSAGE_MODELS:
            raise ConfigError(f"mode={mode!r} is not allowed; use one of {MESSAGE_MODELS}")
        if consume_from not in CONSUME_FROM:
            raise ConfigError(f"consume_from={consume_from!r} is not allowed; use one of {CONSUME_FROM}")
        if mode == "BROADCASTING" and listener is not None and not instances:
            raise ConfigError(
                "a BROADCASTING push group delivers to each of its instances: declare them, "
                "e.g. instances=['host-a', 'host-b']"
            )
        if consume_from == "TIMESTAMP" and consume_timestamp is None:
            raise ConfigError("consume_from='TIMESTAMP' needs consume_timestamp (epoch ms)")
        if consume_timeout is not None:
            if not isinstance(consume_timeout, timedelta):
                raise ConfigError(f"consume_timeout={consume_timeout!r} must be a datetime.timedelta")
            consume_timeout_ms = int(consume_timeout / timedelta(milliseconds=1))
        if max_reconsume_times is None:
            max_reconsume_times = -1 if orderly else 16  # orderly: unlimited (docs/behaviour.md §4)
        for field_name, value, low in (
            ("pull_batch_size", pull_batch_size, 1),
            ("consume_message_batch_max_size", consume_message_batch_max_size, 1),
            ("consume_timeout_ms", consume_timeout_ms, 1),
            ("max_reconsume_times", max_reconsume_times, -1),
            ("invisible_time_ms", invisible_time_ms, 1),
            ("dedup_window_ms", dedup_window_ms, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{field_name}={value!r} is not allowed; it must be an integer >= {low}")
        from deltamq.consumer import validate_retry_policy

        retry_policy = validate_retry_policy(retry_policy)
        from deltamq import dedup

        dedup_key = dedup.validate(self.engine.spark, dedup_key)
        listener_path = _listener_path(self.listeners, name, listener)
        if self._group_exists(name):
            if exist_ok:
                return
            raise AlreadyExists(f"consumer group {name!r} already exists")
        now = self.clock.now_ms()
        inst = "CAST(NULL AS ARRAY<STRING>)"
        if instances:
            inst = "array(" + ", ".join(sql_str(validate_group_name(i, "instance")) for i in instances) + ")"
        statement = (
            f"MERGE INTO {self.warehouse.ref('group_config')} t USING (SELECT "
            f"{sql_str(name)} AS consumer_group, {sql_str(mode)} AS mode, {sql_bool(orderly)} AS orderly, "
            f"{sql_int(max_reconsume_times)} AS max_reconsume_times, "
            f"{sql_int(pull_batch_size)} AS pull_batch_size, "
            f"{sql_int(consume_message_batch_max_size)} AS consume_batch_size, "
            f"{sql_str(consume_from)} AS consume_from, {sql_long(consume_timestamp)} AS consume_timestamp, "
            f"{sql_long(consume_timeout_ms)} AS consume_timeout_ms, {sql_str(dedup_key)} AS dedup_key, "
            f"{sql_str(listener_path)} AS listener, "
            f"{sql_str(json.dumps(retry_policy) if retry_policy else None)} AS retry_policy, "
            f"{sql_long(now)} AS created_ts, {inst} AS instances, "
            f"{sql_long(invisible_time_ms)} AS invisible_time_ms, "
            f"{sql_long(dedup_window_ms)} AS dedup_window_ms, CAST(NULL AS STRING) AS sink_table, "
            "CAST(NULL AS ARRAY<STRING>) AS sink_key_columns, CAST(NULL AS STRING) AS sink_transform) s "
            "ON t.consumer_group = s.consumer_group WHEN NOT MATCHED THEN INSERT *"
        )
        self.engine.commit(lambda: self.engine.execute(statement), what="group_config")
        if mode == "CLUSTERING":
            self._create_system_topic(retry_topic(name), 1)
            self._create_system_topic(dlq_topic(name), 1)
            self._subscribe(name, retry_topic(name), "*", "TAG")

    def delete_group(self, name: str) -> None:
        """Delete a group's configuration, subscriptions and offsets."""
        validate_group_name(name)
        if not self._group_exists(name):
            raise UnknownGroup(f"consumer group {name!r} does not exist")
        g = sql_str(name)
        for table in ("subscription", "offsets", "group_config"):
            statement = f"DELETE FROM {self.warehouse.ref(table)} WHERE consumer_group = {g}"
            self.engine.commit(partial(self.engine.execute, statement), what=table)
        self.listeners.pop(name, None)

    # --- subscriptions --------------------------------------------------------------------
    def subscribe(self, group: str, topic: str, expression: str = "*", type: str = "TAG") -> None:
        """Subscribe ``group`` to ``topic`` with a tag expression (``*`` or ``A || B``)."""
        validate_group_name(group)
        validate_topic_name(topic, allow_system=True)
        if is_system_topic(topic) and not topic.startswith(DLQ_PREFIX):
            raise SystemTopicError(
                f"topic {topic!r} is internal to the engine (delayed, half or retry copies); a "
                f"group may subscribe to user topics and to dead-letter topics ({DLQ_PREFIX}<group>)"
            )
        if not self._group_exists(group):
            raise UnknownGroup(f"consumer group {group!r} does not exist; create it first")
        if self._topic(topic) is None:
            raise UnknownTopic(f"topic {topic!r} does not exist; create it first")
        from deltamq.filters import validate_expression

        expression = validate_expression(expression, type)
        self._subscribe(group, topic, expression, type)
        self._init_offsets(group, topic)

    def _start_offsets(self, topic: str, mode: str, timestamp: int | None) -> dict[int, int]:
        """Per queue of ``topic``: where LAST_OFFSET / FIRST_OFFSET / TIMESTAMP starts."""
        from deltamq.jobs.dispatch import load_state

        heads = {q: o for (t, q), o in load_state(self.warehouse).heads.items() if t == topic}
        if mode == "FIRST_OFFSET" or not heads:
            return {q: 0 for q in heads}
        if mode == "LAST_OFFSET":
            return heads
        firsts = {
            r["queue_id"]: r["lo"]
            for r in self.engine.rows(
                f"SELECT queue_id, min(queue_offset) AS lo FROM {self.warehouse.ref('consume_queue')} "
                f"WHERE topic = {sql_str(topic)} AND store_ts >= {sql_long(timestamp)} GROUP BY queue_id"
            )
        }
        return {q: firsts.get(q, head) for q, head in heads.items()}

    def _init_offsets(self, group: str, topic: str) -> None:
        """Decide where a group starts on a topic, once, when it first subscribes (docs/behaviour.md §3).

        Queues that appear later start at 0 (no row); retry queues always start at 0."""
        from deltamq.tables.offsets import advance_offsets

        have = self.engine.rows(
            f"SELECT count(*) AS n FROM {self.warehouse.ref('offsets')} "
            f"WHERE consumer_group = {sql_str(group)} AND topic = {sql_str(topic)}"
        )[0]["n"]
        if have:
            return
        cfg = self.groups()[group]
        starts = self._start_offsets(topic, cfg["consume_from"], cfg["consume_timestamp"])
        rows = [(topic, q, o, None) for q, o in sorted(starts.items())]
        # CLUSTERING: one offset per queue for the group; BROADCASTING: one per instance.
        clients = [""] if cfg["mode"] == "CLUSTERING" else list(cfg["instances"] or [])
        now = self.clock.now_ms()
        for client in clients if rows else []:
            self.engine.commit(
                partial(advance_offsets, self.warehouse, group, rows, now, client_id=client),
                what="offsets",
            )

    def reset_offsets(self, group: str, to_time: int) -> dict[tuple[str, int], int]:
        """Move a group's offsets on every subscribed topic to the first message stored at
        or after ``to_time`` (epoch ms), back or forward. Returns the new offsets."""
        from deltamq.clock import to_ms

        validate_group_name(group)
        if not self._group_exists(group):
            raise UnknownGroup(f"consumer group {group!r} does not exist")
        to_time = to_ms(to_time)
        new: dict[tuple[str, int], int] = {}
        for sub in self.subscriptions(group):
            for q, o in self._start_offsets(sub["topic"], "TIMESTAMP", to_time).items():
                new[(sub["topic"], q)] = o
        if new:
            values = ", ".join(f"({sql_str(t)}, {q}, {sql_long(o)})" for (t, q), o in sorted(new.items()))
            statement = (
                f"MERGE INTO {self.warehouse.ref('offsets')} t USING (SELECT * FROM VALUES {values} "
                "AS v(topic, queue_id, next_offset)) s "
                f"ON t.consumer_group = {sql_str(group)} AND t.topic = s.topic AND t.queue_id = s.queue_id "
                "AND t.client_id = '' "
                "WHEN MATCHED THEN UPDATE SET t.next_offset = s.next_offset, t.attempts = 0, t.suspends = 0, "
                "t.suspend_until = CAST(NULL AS BIGINT), "
                f"t.attempt_ts = CAST(NULL AS BIGINT), t.updated_ts = {sql_long(self.clock.now_ms())} "
                "WHEN NOT MATCHED THEN INSERT (consumer_group, topic, queue_id, client_id, next_offset, "
                "attempts, suspend_until, progress_version, attempt_ts, updated_ts) VALUES "
                f"({sql_str(group)}, s.topic, s.queue_id, '', s.next_offset, 0, CAST(NULL AS BIGINT), "
                f"CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), {sql_long(self.clock.now_ms())})"
            )
            self.engine.commit(lambda: self.engine.execute(statement), what="offsets")
        return new

    def _subscribe(self, group: str, topic: str, expression: str, expr_type: str) -> None:
        statement = (
            f"MERGE INTO {self.warehouse.ref('subscription')} t USING (SELECT "
            f"{sql_str(group)} AS consumer_group, {sql_str(topic)} AS topic, "
            f"{sql_str(expr_type)} AS expr_type, {sql_str(expression)} AS expression, "
            f"{sql_long(self.clock.now_ms())} AS created_ts) s "
            "ON t.consumer_group = s.consumer_group AND t.topic = s.topic "
            "WHEN MATCHED THEN UPDATE SET t.expr_type = s.expr_type, t.expression = s.expression "
            "WHEN NOT MATCHED THEN INSERT *"
        )
        self.engine.commit(lambda: self.engine.execute(statement), what="subscription")

    def subscriptions(self, group: str | None = None) -> list[dict[str, Any]]:
        where = "" if group is None else f" WHERE consumer_group = {sql_str(group)}"
        rows = self.engine.rows(
            f"SELECT consumer_group, topic, expr_type, expression FROM {self.warehouse.ref('subscription')}"
            f"{where} ORDER BY consumer_group, topic"
        )
        return [r.asDict() for r in rows]

    # --- producing --------------------------------------------------------------------------
    def producer(
        self, group: str = "DEFAULT_PRODUCER", *, check_listener: Callable[..., Any] | str | None = None
    ) -> Producer:
        """A producer for ``group``.

        ``check_listener`` answers transaction check-back for the group (docs/behaviour.md §5):
        ``fn(message) -> TxState`` as a callable (this process only, unless it is a
        module-level function, whose import path is stored) or an import path
        ``"package.module:function"`` stored in ``producer_config`` for jobs started
        elsewhere. It replaces a table check set by :meth:`check_with_table`.
        """
        producer = Producer(self, group)
        if check_listener is not None:
            path = _listener_path(self.check_listeners, producer.group, check_listener)
            self._set_check(producer.group, listener=path)
        return producer

    def check_with_table(
        self,
        producer_group: str,
        table: str,
        key_property: str,
        state_expression: str,
        *,
        key_column: str | None = None,
    ) -> None:
        """Answer the group's transaction check-back from a Delta table of local state.

        Each pass joins the group's half messages, by their ``key_property`` property,
        with ``table`` (a Delta path or table name) on ``key_column`` (default: the same
        name as the property) and evaluates ``state_expression`` over the table's row, e.g.
        ``CASE WHEN status = 'PAID' THEN 'COMMIT' WHEN status = 'CANCELLED' THEN
        'ROLLBACK' END``. NULL, anything else, a missing row or rows that disagree mean
        UNKNOWN. It replaces a check listener set for the group.
        """
        from deltamq.transactions import CheckConfig, validate_table_check

        group = validate_group_name(producer_group, "producer group")
        for name, value in (
            ("table", table),
            ("key_property", key_property),
            ("state_expression", state_expression),
        ):
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{name}={value!r} must be a non-empty string")
        cfg = CheckConfig(group, None, table, key_property, key_column or key_property, state_expression)
        validate_table_check(self.engine.spark, cfg)
        self.check_listeners.pop(group, None)
        self._set_check(
            group,
            table=cfg.table,
            key_property=cfg.key_property,
            key_column=cfg.key_column,
            state_expression=cfg.state_expression,
        )

    def _set_check(
        self,
        group: str,
        *,
        listener: str | None = None,
        table: str | None = None,
        key_property: str | None = None,
        key_column: str | None = None,
        state_expression: str | None = None,
    ) -> None:
        now = self.clock.now_ms()
        source = (
            f"SELECT {sql_str(group)} AS producer_group, {sql_str(listener)} AS check_listener, "
            f"{sql_str(table)} AS check_table, {sql_str(key_property)} AS check_key_property, "
            f"{sql_str(key_column)} AS check_key_column, "
            f"{sql_str(state_expression)} AS check_state_expression, "
            f"{sql_long(now)} AS updated_ts"
        )
        statement = (
            f"MERGE INTO {self.warehouse.ref('producer_config')} t USING ({source}) s "
            "ON t.producer_group = s.producer_group "
            "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
        )
        self.engine.commit(lambda: self.engine.execute(statement), what="producer_config")

    def check_configs(self) -> dict[str, Any]:
        """Per producer group, how check-back is answered (``CheckConfig``), from
        ``producer_config`` plus the check listeners registered in this process."""
        from deltamq.transactions import CheckConfig

        out: dict[str, Any] = {}
        for r in self.engine.rows(f"SELECT * FROM {self.warehouse.ref('producer_config')}"):
            out[r["producer_group"]] = CheckConfig(
                r["producer_group"],
                r["check_listener"],
                r["check_table"],
                r["check_key_property"],
                r["check_key_column"],
                r["check_state_expression"],
            )
        for group in self.check_listeners:
            out.setdefault(group, CheckConfig(group))
        return out

    def pull_consumer(self, group: str, client_id: str):
        """A pull client of a CLUSTERING group without a push listener (docs/behaviour.md §6): its share
        of the group's queues, guarded by the queue access lock."""
        from deltamq.pull import PullConsumer

        return PullConsumer(self, group, client_id)

    def sink_to_table(
        self,
        group: str,
        table_path: str,
        key_columns: str | list[str],
        transform: Callable[..., Any] | str | None = None,
    ):
        """Make ``group`` an exactly-once Delta sink (see :mod:`deltamq.sink`): each sink
        pass (the tick's ``sink`` job) MERGEs the group's new messages into the Delta table
        at ``table_path`` on ``key_columns``, guarded so that a replay after any crash
        changes nothing. ``transform`` (a callable or ``"package.module:function"``) maps
        the messages DataFrame (:data:`deltamq.sink.MESSAGE_SCHEMA`) to the table's rows and
        must keep ``_deltamq_order``. A missing table is created (empty) now.
        Returns the :class:`~deltamq.sink.Sink`."""
        from deltamq import sink

        group = validate_group_name(group)
        table = sink.validate_table_path(self, table_path)
        keys = sink.validate_keys(key_columns)
        sink.check_group(self, group)
        registry: dict[str, Callable[..., Any]] = {}
        path = _listener_path(registry, group, transform)
        cfg = sink.SinkConfig(group, table, keys, path)
        fn = registry.get(group) or (sink.load_transform(self, cfg) if path else None)
        # the transform and the table are checked now, on an empty batch
        empty = self.engine.spark.createDataFrame([], sink.MESSAGE_SCHEMA)
        sink.ensure_table(self, cfg, sink.output(self, cfg, empty, fn))
        if registry:
            self.sink_transforms[group] = registry[group]
        else:
            self.sink_transforms.pop(group, None)
        keys_sql = "array(" + ", ".join(sql_str(k) for k in keys) + ")"
        statement = (
            f"UPDATE {self.warehouse.ref('group_config')} SET sink_table = {sql_str(table)}, "
            f"sink_key_columns = {keys_sql}, sink_transform = {sql_str(path)} "
            f"WHERE consumer_group = {sql_str(group)}"
        )
        self.engine.commit(lambda: self.engine.execute(statement), what="group_config")
        return sink.Sink(self, group)

    # --- operating ------------------------------------------------------------------------
    def dead_letters(self, **selection: Any) -> DataFrame:
        """Dead letters selected by ``group``, store-time range ``since``/``until``,
        ``msg_ids`` and/or ``where`` (an SQL predicate over the ``consume_queue`` row);
        see :func:`deltamq.ops.dead_letters`."""
        from deltamq import ops

        return ops.dead_letters(self, **selection)

    def resend_dead_letters(self, *, rate_per_s: float | None = None, **selection: Any):
        """Send the selected dead letters (``dead_letters`` arguments) back to their
        original topic, each once, at most ``rate_per_s`` per second."""
        from deltamq import ops

        return ops.resend(self, self.dead_letters(**selection), rate_per_s=rate_per_s)

    def check_quality(self, tables: list[str] | None = None, *, record: bool = True):
        """Run the data-quality suites (every table's, plus ``"conservation"``) and append
        the results to ``dq_results``; returns a :class:`deltamq.dq.suites.QualityResult`
        (``success``, ``failures`` with expectation, table, unexpected count, sample ids)."""
        from deltamq.dq import suites

        return suites.run(self, tables=tables, record=record)

    def trace(self, msg_id: str) -> list[dict[str, Any]]:
        """The message's history: sent, delayed, retries, dead letter, resends, and which
        groups consumed or sent back each copy (see :func:`deltamq.ops.trace`)."""
        from deltamq import ops

        return ops.trace(self, msg_id)

    def find_by_key(self, key: str, *, since: int | None = None, until: int | None = None) -> list[str]:
        """Ids of the messages sent with business key ``key``."""
        from deltamq import ops

        return ops.find_by_key(self, key, since=since, until=until)

    def max_delay_level(self) -> int:
        if self._max_level is None:
            levels = self.warehouse.levels()
            self._max_level = max((lvl for lvl, _ in levels), default=0)
        return self._max_level

    def append_commit_log(self, rows: pa.Table | DataFrame, *, what: str) -> None:
        """Blind-append stored messages to commit_log (one commit)."""
        df = rows if not _is_arrow(rows) else self.engine.spark.createDataFrame(rows)
        self.engine.commit(lambda: self.warehouse.append("commit_log", df), what=what)

    # --- ticking ---------------------------------------------------------------------------
    @property
    def runner(self):
        """This broker's tick runner (holds the job leases between ticks)."""
        if self._runner is None:
            from deltamq.orchestration.tick import TickRunner

            self._runner = TickRunner(self)
        return self._runner

    def tick(self, now: int | None = None):
        """Run one tick of the broker's jobs at ``now`` (default: the broker's clock).

        Returns a TickResult with per-job counts; the tick is recorded in job_runs.
        """
        return self.runner.tick(now)

    # --- status -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Topics, and per (topic, queue) the offsets indexed so far; messages stored
        but not yet dispatched (from the Delta commit entries' record counts)."""
        from deltamq.jobs.dispatch import load_state
        from deltamq.tables import deltalog

        state = load_state(self.warehouse)
        minimums = {
            (r["topic"], r["queue_id"]): r["lo"]
            for r in self.engine.rows(
                f"SELECT topic, queue_id, min(queue_offset) AS lo FROM {self.warehouse.ref('consume_queue')} "
                "GROUP BY topic, queue_id"
            )
        }
        queues = [
            {"topic": t, "queue_id": q, "min_offset": minimums.get((t, q), 0), "max_offset": nxt}
            for (t, q), nxt in sorted(state.heads.items())
        ]
        pending = sum(
            f.num_records or 0
            for c in deltalog.commits_after(
                self.warehouse.storage, self.warehouse.uri("commit_log"), state.version, 1_000_000
            )
            for f in c.files
        )
        from deltamq.jobs import promote

        held = promote.pending(self.warehouse)
        lag = []
        for r in self.engine.rows(
            f"SELECT consumer_group, client_id, topic, queue_id, next_offset, suspend_until "
            f"FROM {self.warehouse.ref('offsets')} WHERE {USER_GROUPS} "
            "ORDER BY consumer_group, client_id, topic, queue_id"
        ):
            head = state.heads.get((r["topic"], r["queue_id"]), 0)
            lag.append(
                {
                    "group": r["consumer_group"],
                    "client": r["client_id"],
                    "topic": r["topic"],
                    "queue_id": r["queue_id"],
                    "next_offset": r["next_offset"],
                    "lag": max(0, head - (r["next_offset"] or 0)),
                    "suspend_until": r["suspend_until"],
                }
            )
        dlq = {t: n for (t, _), n in state.heads.items() if t.startswith("%DLQ%")}
        from deltamq import pull
        from deltamq.jobs import check_transactions

        return {
            "topics": self.topics(),
            "queues": queues,
            "dispatched_version": state.version,
            "undispatched": pending,
            "levels": held["levels"],
            "timers": held["timers"],
            "lag": lag,
            "dead_letters": dlq,
            "transactions": check_transactions.pending(self, self.clock.now_ms()),
            "pull_clients": pull.status(self, self.clock.now_ms()),
            "recent_runs": self.recent_runs(),
        }

    def recent_runs(self, limit: int = 10) -> list[dict[str, Any]]:
        """The last ``limit`` ticks' job rows (``job_runs``, read from yesterday's
        partition on when the warehouse has recent ticks)."""
        wh = self.warehouse
        latest = self.engine.rows(f"SELECT max(run_date) AS d FROM {wh.ref('job_runs')}")[0]["d"]
        if latest is None:
            return []
        recent = f"run_date >= date_sub(DATE'{latest.isoformat()}', 1)"
        # (Sail cannot ORDER BY an aggregate that is not selected: select it as t)
        rows = self.engine.rows(
            "SELECT r.tick_id, r.now_ts, r.job, r.status, r.rows_in, r.rows_out, "
            f"r.end_ts - r.start_ts AS ms, r.error FROM {wh.ref('job_runs')} r "
            "JOIN (SELECT tick_id, max(now_ts) AS t FROM "
            f"{wh.ref('job_runs')} WHERE {recent} GROUP BY tick_id ORDER BY t DESC LIMIT {int(limit)}) k "
            f"ON r.tick_id = k.tick_id WHERE r.{recent} ORDER BY r.now_ts DESC, r.start_ts"
        )
        return [r.asDict() for r in rows]


def _listener_path(
    registry: dict[str, Callable[..., Any]], group: str, listener: Callable[..., Any] | str | None
) -> str | None:
    """The import path to store for ``listener``; a callable is also kept in ``registry``
    for this process (its path is stored only when another process could import it)."""
    if listener is None:
        return None
    if isinstance(listener, str):
        module, sep, attr = listener.partition(":")
        if not sep or not module or not attr:
            raise ConfigError(f"listener {listener!r} is not an import path; use 'package.module:function'")
        return listener
    if not callable(listener):
        raise ConfigError(f"listener {listener!r} is neither a callable nor an import path")
    registry[group] = listener
    owner = inspect.getmodule(listener)
    qualname = getattr(listener, "__qualname__", "")
    if owner is None or "<" in qualname or owner.__name__ == "__main__":
        return None  # in-process only: jobs started elsewhere cannot import it
    return f"{owner.__name__}:{qualname}"


def _is_arrow(obj: object) -> bool:
    return type(obj).__module__.startswith("pyarrow")


__all__ = ["Broker", "DeltaMQError"]
