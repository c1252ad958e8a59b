"""``deltamq.Broker``: the facade over one warehouse: open it, administer it, produce,
consume, operate and tick.

It holds a :class:`deltamq.context.Context` (engine, warehouse, clock, configuration,
catalog) and a tick runner, and delegates: administration to the catalog, jobs to the
runner, pull clients, sinks, data quality and operator tools to their modules, each
given the context. Nothing below it imports it (docs/architecture.md).

Example:
    >>> from deltamq import Broker, Message, FakeClock
    >>> broker = Broker.open("/tmp/wh", clock=FakeClock())
    >>> broker.create_topic("orders", queues=4)
    >>> broker.producer("shop").send(Message("orders", b"hello"))
    >>> broker.sql("SELECT topic, count(*) FROM commit_log GROUP BY topic").show()
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from deltamq.catalog import Catalog, new_group_config
from deltamq.clock import Clock, SystemClock, to_ms
from deltamq.config import BrokerConfig, ConsumeFrom, GroupConfig, MessageModel, Subscription
from deltamq.context import Context
from deltamq.engine import Engine
from deltamq.errors import ConfigError, DeltaMQError, InUse
from deltamq.message import validate_group_name
from deltamq.producer import Producer
from deltamq.tables.sqlguard import check_read_only
from deltamq.tables.warehouse import Warehouse
from deltamq.transactions import CheckConfig

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from deltamq.dq.suites import QualityResult
    from deltamq.jobs.sink import Sink
    from deltamq.ops import ResendResult
    from deltamq.orchestration.tick import TickResult, TickRunner
    from deltamq.pull import PullConsumer


class Broker:
    """One warehouse of deltamq tables and the engine that works on them."""

    def __init__(self, warehouse: Warehouse, clock: Clock, config: BrokerConfig) -> None:
        self.context = Context.of(warehouse, clock, config)
        self._runner: TickRunner | None = None

    @property
    def engine(self) -> Engine:
        return self.context.engine

    @property
    def warehouse(self) -> Warehouse:
        return self.context.warehouse

    @property
    def clock(self) -> Clock:
        return self.context.clock

    @property
    def config(self) -> BrokerConfig:
        return self.context.config

    @property
    def catalog(self) -> Catalog:
        return self.context.catalog

    @property
    def spark(self) -> SparkSession:
        """The Spark session this broker works through (Spark Connect to the embedded Sail
        server, a remote endpoint, or a classic session): build DataFrames to send with
        ``producer.send_dataframe``, or query the tables yourself."""
        return self.engine.spark

    def reconfigure(self, **changes: Any) -> BrokerConfig:
        """Change settings of this broker from now on, e.g. ``reconfigure(compact=False)``:
        a new validated :class:`BrokerConfig` for its context, catalog and tick runner."""
        self.context = self.context.reconfigured(**changes)
        if self._runner is not None:
            self._runner.ctx = self.context
        return self.context.config

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
        create: bool = False,
        levels: str | None = None,
    ) -> Broker:
        """Open the warehouse at ``warehouse``; raise :class:`WarehouseNotFound` (creating
        nothing) if there is none, unless ``create=True`` (or :meth:`init`).

        ``remote`` is a Spark Connect URL; ``spark`` an existing session (classic or
        Connect); neither means the embedded Sail engine. ``clock`` defaults to the
        system clock. An existing warehouse must be at this release's schema version
        (``Broker.init`` or ``deltamq init`` upgrades older ones). ``levels`` (e.g.
        ``"1s 5s 1m"``) sets the delay levels of a warehouse being created.
        """
        return cls._open(warehouse, remote, spark, clock, config, "create" if create else "open", levels)

    @classmethod
    def _open(
        cls,
        warehouse: str | os.PathLike[str],
        remote: str | None,
        spark: SparkSession | None,
        clock: Clock | None,
        config: BrokerConfig | None,
        how: Literal["open", "create", "init"],
        levels: str | None,
    ) -> Broker:
        if config is None:
            config = BrokerConfig.from_env(None, **({"remote": remote} if remote else {}))
        elif remote:
            config = BrokerConfig(**{**config.__dict__, "remote": remote, "engine": "remote"})
        engine = Engine.open(config, spark=spark)
        wh = Warehouse(engine, warehouse, storage_options=config.storage_options)
        broker = cls(wh, clock or SystemClock(), config)
        if how == "init" or (how == "create" and wh.schema_version() is None):
            wh.init(levels, config=config)
        wh.ensure_ready()
        return broker

    @classmethod
    def init(
        cls,
        warehouse: str | os.PathLike[str],
        *,
        remote: str | None = None,
        spark: SparkSession | None = None,
        clock: Clock | None = None,
        config: BrokerConfig | None = None,
        levels: str | None = None,
    ) -> Broker:
        """Create the warehouse at ``warehouse``, or upgrade an older one in place, and open
        it: what ``deltamq init`` does. Idempotent; ``levels`` (e.g. ``"1s 5s 1m"``)
        replaces the delay levels when given: at least as many as the warehouse has (a
        message held at a removed level would never be delivered), else ConfigError."""
        return cls._open(warehouse, remote, spark, clock, config, "init", levels)

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
        self.warehouse.register_views(query)  # the tables and views the query names
        return self.engine.sql(query)

    def register(self, database: str = "deltamq") -> list[str]:
        """Name the warehouse's tables and views ``database.<name>`` in this broker's Spark
        session catalog (see :func:`deltamq.register` for another session)."""
        return self.warehouse.register_catalog(database)

    def table(self, name: str) -> DataFrame:
        """A table as a DataFrame."""
        return self.warehouse.read(name)

    # --- topics ----------------------------------------------------------------------------
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
        self.catalog.create_topic(name, queues, perm, ordered=ordered, exist_ok=exist_ok)

    def update_topic(
        self,
        name: str,
        *,
        queues: int | None = None,
        perm: str | None = None,
        ordered: bool | None = None,
        force: bool = False,
    ) -> None:
        """Change a topic's queue count, permission or order flag. Fewer queues while the
        queues dropped hold messages a subscribed group has not consumed is refused
        (:class:`InUse`, naming each group and how many), unless ``force``: nothing reads
        a dropped queue until the count grows back."""
        if queues is not None and not force and isinstance(queues, int) and not isinstance(queues, bool):
            current = self.catalog.topic_queues(name)
            if 1 <= queues < current:
                from deltamq.inspection import topic_subscribers

                stranded = {g: n for g, n in topic_subscribers(self.context, name, queues).items() if n}
                if stranded:
                    raise InUse(
                        f"topic {name!r}: queues {queues}..{current - 1} hold messages that dropping them "
                        f"would leave unread: {_not_consumed(stranded)}. Stop producing to them first "
                        "(perm, or your selector) and let the groups catch up, or update with force=True "
                        "(CLI: --force)"
                    )
        self.catalog.update_topic(name, queues=queues, perm=perm, ordered=ordered)

    def delete_topic(self, name: str, *, force: bool = False) -> None:
        """Delete a topic's configuration and its subscriptions. Stored messages stay
        until retention removes them (docs/behaviour.md §8); producers are refused at once.
        A topic that groups subscribe to is refused (:class:`InUse`, naming each group and
        the messages it has not consumed) unless ``force``."""
        from deltamq.inspection import topic_subscribers

        self.catalog.require_topic(name)
        subscribers = {} if force else topic_subscribers(self.context, name)
        if subscribers:
            raise InUse(
                f"topic {name!r} has subscriptions that deleting it drops: {_not_consumed(subscribers)}; "
                f"{sum(subscribers.values())} not consumed in all, counted once per group. "
                f"Unsubscribe them first (unsubscribe(group, {name!r}); CLI: deltamq unsubscribe GROUP "
                f"{name}), or delete with force=True (CLI: --force)"
            )
        self.catalog.delete_topic(name)

    def topics(self) -> dict[str, dict[str, Any]]:
        """Every topic with its queues, perm and order flag."""
        return self.catalog.topics()

    def topic_queues(self, topic: str) -> int:
        return self.catalog.topic_queues(topic)

    # --- groups ----------------------------------------------------------------------------
    def groups(self) -> dict[str, GroupConfig]:
        """Every consumer group's configuration, by name."""
        return self.catalog.groups()

    def create_group(
        self,
        name: str,
        listener: Callable[..., Any] | str | None = None,
        *,
        mode: MessageModel = "CLUSTERING",
        orderly: bool = False,
        max_reconsume_times: int | None = None,
        pull_batch_size: int = 0,
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
        ``pull_batch_size``: messages taken per queue per tick; 0 (the default) takes as
        many as the pass's budget allows (``BrokerConfig.deliver_max_bytes``).
        ``invisible_time_ms``: pull consumers — a pulled message not acked within it counts
        as RECONSUME_LATER. ``dedup_key`` (``UNIQ_KEY``, ``KEYS`` or an SQL expression over
        the consume_queue row): a message whose key the group consumed successfully within
        ``dedup_window_ms`` is acknowledged without reaching the listener (docs/behaviour.md §7).
        """
        if consume_timeout is not None:
            if not isinstance(consume_timeout, timedelta):
                raise ConfigError(f"consume_timeout={consume_timeout!r} must be a datetime.timedelta")
            consume_timeout_ms = int(consume_timeout / timedelta(milliseconds=1))
        cfg = new_group_config(
            name,
            mode=mode,
            orderly=orderly,
            max_reconsume_times=max_reconsume_times,
            pull_batch_size=pull_batch_size,
            consume_batch_size=consume_message_batch_max_size,
            consume_from=consume_from,
            consume_timestamp=consume_timestamp,
            consume_timeout_ms=consume_timeout_ms,
            dedup_key=dedup_key,
            retry_policy=retry_policy,
            instances=tuple(instances or ()),
            invisible_time_ms=invisible_time_ms,
            dedup_window_ms=dedup_window_ms,
        )
        self.catalog.create_group(cfg, listener, exist_ok=exist_ok)

    def update_group(
        self,
        name: str,
        listener: Callable[..., Any] | str | None = None,
        *,
        max_reconsume_times: int | None = None,
        pull_batch_size: int | None = None,
        consume_message_batch_max_size: int | None = None,
        consume_timeout: timedelta | None = None,
        retry_policy: dict[str, Any] | None = None,
        instances: list[str] | None = None,
        invisible_time_ms: int | None = None,
        dedup_window_ms: int | None = None,
    ) -> dict[str, tuple[Any, Any]]:
        """Change an existing group's settings in place, keeping its offsets (RocketMQ's
        ``updateSubGroup``): a push group's ``listener``, and the settings given (None:
        unchanged). Returns ``{setting: (old, new)}`` of what changed; the next tick uses
        them. A BROADCASTING instance added starts where the group's ``consume_from`` says;
        one removed loses its offsets. Mode, ordering, ``dedup_key`` and ``consume_from``
        cannot change in place (ConfigError, naming them)."""
        given: dict[str, Any] = {
            "max_reconsume_times": max_reconsume_times,
            "pull_batch_size": pull_batch_size,
            "consume_batch_size": consume_message_batch_max_size,
            "retry_policy": retry_policy,
            "instances": None if instances is None else tuple(instances),
            "invisible_time_ms": invisible_time_ms,
            "dedup_window_ms": dedup_window_ms,
        }
        if consume_timeout is not None:
            if not isinstance(consume_timeout, timedelta):
                raise ConfigError(f"consume_timeout={consume_timeout!r} must be a datetime.timedelta")
            given["consume_timeout_ms"] = int(consume_timeout / timedelta(milliseconds=1))
        settings = {k: v for k, v in given.items() if v is not None}
        if not settings and listener is None:
            raise ConfigError(f"update_group({name!r}) needs what to change: a listener or a setting")
        return self.catalog.update_group(name, settings, listener)

    def delete_group(self, name: str, *, force: bool = False) -> None:
        """Delete a group's configuration, subscriptions, offsets, pull clients' state and
        consumed dedup keys: a group created again under the name starts afresh. A group with messages
        not consumed yet, retries waiting or pulled messages not acked is refused
        (:class:`InUse`, with the counts) unless ``force``."""
        from deltamq.inspection import group_holdings

        self.catalog.require_group(name)
        held = {} if force else group_holdings(self.context, name)
        if any(held.values()):
            raise InUse(
                f"consumer group {name!r} still has {held['unconsumed']} messages not consumed "
                f"({held['retried']} of them retries due again in its retry topic, "
                f"{held['in_flight']} pulled and not acked) and {held['in_retry']} retries waiting "
                "for their delay level, which deleting it drops; consume them, or delete with "
                "force=True (CLI: --force)"
            )
        self.catalog.delete_group(name)

    # --- subscriptions --------------------------------------------------------------------
    def subscribe(
        self, group: str, topic: str, expression: str = "*", type: str = "TAG"
    ) -> Subscription | None:
        """Subscribe ``group`` to ``topic`` with a tag expression (``*`` or ``A || B``) or,
        ``type="SQL92"``, a predicate over the message's properties. A group has one
        subscription per topic, as in RocketMQ: subscribing again replaces it; returns the
        subscription replaced (None: there was none)."""
        before = [s for s in self.catalog.subscriptions(group) if s.topic == topic]
        self.catalog.subscribe(group, topic, expression, type)
        return before[0] if before else None

    def unsubscribe(self, group: str, topic: str) -> None:
        """Stop ``group`` consuming ``topic`` (RocketMQ's ``unsubscribe``). What it has not
        consumed stays stored; its offsets stay too, so subscribing again goes on from them."""
        self.catalog.unsubscribe(group, topic)

    def subscriptions(self, group: str | None = None) -> list[Subscription]:
        return self.catalog.subscriptions(group)

    def reset_offsets(self, group: str, to_time: int) -> dict[tuple[str, int], int]:
        """Move a group's offsets on every subscribed topic to the first message stored at
        or after ``to_time`` (epoch ms or datetime), back or forward. Returns the new offsets.
        A pull group's clients restart there: what they hold in flight is revoked and their
        queue locks are released (:func:`deltamq.pull_log.restart_queues`)."""
        new = self.catalog.offsets_at(group, to_ms(to_time))
        cfg = self.catalog.require_group(group)
        restart: AbstractContextManager[None] = nullcontext()
        if cfg.mode == "CLUSTERING" and not cfg.listener and not cfg.sink_table:
            from deltamq.pull_engine import EngineStore
            from deltamq.pull_log import restart_queues

            # the log's restart first: a fold of the log that read it before would otherwise
            # write the old acknowledged offsets over the new ones (offsets never go back there)
            restart = restart_queues(EngineStore(self.context), group, new, self.clock.now_ms())
        with restart:
            self.catalog.set_offsets(group, new)
        return new

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
        producer = Producer(self.context, group)
        if check_listener is not None:
            self.catalog.set_check_listener(producer.group, check_listener)
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
        with ``table`` (an absolute path or URI of a Delta table, or a table name) on
        ``key_column`` (default: the same name as the property) and evaluates
        ``state_expression`` over the table's row, e.g.
        ``CASE WHEN status = 'PAID' THEN 'COMMIT' WHEN status = 'CANCELLED' THEN
        'ROLLBACK' END``. NULL, anything else, a missing row or rows that disagree mean
        UNKNOWN. It replaces a check listener set for the group.
        """
        group = validate_group_name(producer_group, "producer group")
        for name, value in (
            ("table", table),
            ("key_property", key_property),
            ("state_expression", state_expression),
        ):
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{name}={value!r} must be a non-empty string")
        self.catalog.set_check_table(
            CheckConfig(group, None, table, key_property, key_column or key_property, state_expression)
        )

    def check_configs(self) -> dict[str, CheckConfig]:
        """Per producer group, how check-back is answered."""
        return self.catalog.check_configs()

    def append_commit_log(self, rows: pa.Table | DataFrame, *, what: str) -> None:
        """Blind-append stored messages to commit_log (one commit)."""
        self.context.append_commit_log(rows, what=what)

    def max_delay_level(self) -> int:
        return self.catalog.max_delay_level()

    # --- registered callables ---------------------------------------------------------------
    @property
    def listeners(self) -> dict[str, Callable[..., Any]]:
        """Push listeners registered in this process, by group."""
        return self.catalog.listeners

    @property
    def check_listeners(self) -> dict[str, Callable[..., Any]]:
        return self.catalog.check_listeners

    @property
    def sink_transforms(self) -> dict[str, Callable[..., Any]]:
        return self.catalog.sink_transforms

    # --- consuming --------------------------------------------------------------------------
    def pull_consumer(self, group: str, client_id: str) -> PullConsumer:
        """A pull client of a CLUSTERING group without a push listener (docs/behaviour.md §6): its share
        of the group's queues, guarded by the queue access lock. Its process's Arrow
        buffers come from ``pull_memory_pool`` from then on (deltamq/arrow_memory.py)."""
        from deltamq.arrow_memory import use_pool
        from deltamq.pull import PullConsumer
        from deltamq.pull_engine import EngineStore

        client = PullConsumer(EngineStore(self.context), group, client_id)
        use_pool(self.config.pull_memory_pool)  # once the group is found
        return client

    def sink_to_table(
        self,
        group: str,
        table_path: str,
        key_columns: str | list[str],
        transform: Callable[..., Any] | str | None = None,
    ) -> Sink:
        """Make ``group`` an exactly-once Delta sink (see :mod:`deltamq.jobs.sink`): each sink
        pass (the tick's ``sink`` job) MERGEs the group's new messages into the Delta table
        at ``table_path`` on ``key_columns``, guarded so that a replay after any crash
        changes nothing. ``transform`` (a callable or ``"package.module:function"``) maps
        the messages DataFrame (:data:`deltamq.jobs.sink.MESSAGE_SCHEMA`) to the table's rows and
        must keep ``_deltamq_order``. A missing table is created (empty) now.
        Returns the :class:`~deltamq.jobs.sink.Sink`."""
        from deltamq.jobs import sink

        return sink.configure(self.context, group, table_path, key_columns, transform)

    # --- operating ------------------------------------------------------------------------
    def dead_letters(self, **selection: Any) -> DataFrame:
        """Dead letters selected by ``group``, store-time range ``since``/``until``,
        ``msg_ids`` and/or ``where`` (an SQL predicate over the ``consume_queue`` row);
        see :func:`deltamq.ops.dead_letters`."""
        from deltamq import ops

        return ops.dead_letters(self.context, **selection)

    def resend_dead_letters(self, *, rate_per_s: float | None = None, **selection: Any) -> ResendResult:
        """Send the selected dead letters (``dead_letters`` arguments) back to their
        original topic, each once, at most ``rate_per_s`` per second."""
        from deltamq import ops

        return ops.resend(self.context, self.dead_letters(**selection), rate_per_s=rate_per_s)

    def check_quality(self, tables: list[str] | str | None = None, *, record: bool = True) -> QualityResult:
        """Run the data-quality suites (every table's, plus ``"conservation"``) and append
        the results to ``dq_results``; returns a :class:`deltamq.dq.suites.QualityResult`
        (``success``, ``failures`` with expectation, table, unexpected count, sample ids)."""
        from deltamq.dq import suites

        return suites.run(self.context, tables=tables, record=record)

    def trace(self, msg_id: str) -> list[dict[str, Any]]:
        """The message's history: sent, delayed, retries, dead letter, resends, and which
        groups consumed or sent back each copy (see :func:`deltamq.ops.trace`)."""
        from deltamq import ops

        return ops.trace(self.context, msg_id)

    def find_by_key(self, key: str, *, since: int | None = None, until: int | None = None) -> list[str]:
        """Ids of the messages sent with business key ``key``."""
        from deltamq import ops

        return ops.find_by_key(self.context, key, since=since, until=until)

    def rebuild_index(self, now: int | None = None) -> dict[str, int]:
        """Rebuild ``consume_queue`` from ``commit_log`` holding every job lease (see
        :func:`deltamq.ops.rebuild_index`)."""
        from deltamq import ops

        try:
            return ops.rebuild_index(
                self.context, self.runner.leases, self.clock.now_ms() if now is None else now
            )
        finally:
            self.runner.release()

    def status(self) -> dict[str, Any]:
        """Topics, queues, undispatched messages, delay levels, timers, group lag, dead
        letters, transactions, pull clients and recent job runs (:func:`deltamq.inspection.status`)."""
        from deltamq import inspection

        return inspection.status(self.context)

    def recent_runs(self, limit: int = 10) -> list[dict[str, Any]]:
        """The last ``limit`` ticks' job rows (``job_runs``)."""
        from deltamq import inspection

        return inspection.recent_runs(self.context, limit)

    # --- ticking ---------------------------------------------------------------------------
    @property
    def runner(self) -> TickRunner:
        """This broker's tick runner (holds the job leases between ticks)."""
        if self._runner is None:
            from deltamq.orchestration.tick import TickRunner

            self._runner = TickRunner(self.context)
        return self._runner

    def tick(self, now: int | None = None) -> TickResult:
        """Run one tick of the broker's jobs at ``now`` (default: the broker's clock).

        Returns a TickResult with per-job counts; the tick is recorded in job_runs.
        """
        return self.runner.tick(now)


__all__ = ["Broker", "DeltaMQError"]


def register(
    spark: SparkSession,
    warehouse: str | os.PathLike[str],
    *,
    database: str = "deltamq",
    config: BrokerConfig | None = None,
) -> list[str]:
    """Name a warehouse's tables (external Delta tables) and views ``database.<name>`` in
    ``spark``'s catalog, so ``spark.sql("SELECT * FROM mq.messages")`` works in a notebook
    or ``spark-sql``: on Apache Spark with delta-spark (persistent with a Hive metastore,
    for the session otherwise) and on Sail. Returns the names registered. ``config``
    carries storage options (credentials come from the environment by default)."""
    config = config or BrokerConfig.from_env(None)
    engine = Engine.open(config, spark=spark)
    wh = Warehouse(engine, warehouse, storage_options=config.storage_options)
    return wh.register_catalog(database)


def _not_consumed(groups: dict[str, int]) -> str:
    """``billing (3 not consumed), shipping (1 not consumed)``: what an InUse refusal names."""
    return ", ".join(f"{g} ({n} not consumed)" for g, n in sorted(groups.items()))
