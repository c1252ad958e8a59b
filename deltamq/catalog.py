"""The catalog: topics, consumer groups, subscriptions and producer check-back settings
as stored in a warehouse, plus the callables registered in this process.

It owns every write to ``topic_config``, ``group_config``, ``subscription`` and
``producer_config``, the offsets a group starts from when it subscribes (or is
reset), and the deletion of a group's rows from every table that holds any
(:data:`GROUP_TABLES`). Jobs read it through their :class:`deltamq.context.Context`; the ``Broker``
facade delegates its administration calls here. It sits above the tables layer and
below the jobs: it imports nothing from them.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from deltamq import dedup, file_reads
from deltamq.clock import Clock
from deltamq.config import (
    EXPRESSION_TYPES,
    BrokerConfig,
    ConsumeFrom,
    GroupConfig,
    MessageModel,
    Subscription,
)
from deltamq.constants import (
    DLQ_PREFIX,
    MAX_QUEUES,
    RETRY_PREFIX,
    Perm,
    dlq_topic,
    is_system_topic,
    retry_topic,
)
from deltamq.consumer import IN_PROCESS, resolve_listener
from deltamq.errors import (
    AlreadyExists,
    ConfigError,
    InProcessListener,
    SystemTopicError,
    UnknownGroup,
    UnknownTopic,
)
from deltamq.filters import validate_expression
from deltamq.message import validate_group_name, validate_topic_name
from deltamq.schemas import GROUP_CONFIG
from deltamq.sending import Topics
from deltamq.tables import consume_queue
from deltamq.tables.consume_queue import visible_heads
from deltamq.tables.offsets import (
    OffsetsMerge,
    clients_with_offsets,
    drop_positions,
    forget_clients,
    fresh_head,
    holds_positions,
    source,
    start_positions,
)
from deltamq.tables.sqltext import sql_bool, sql_int, sql_long, sql_str
from deltamq.transactions import CheckConfig, validate_table_check

if TYPE_CHECKING:
    from deltamq.engine import Engine
    from deltamq.tables.warehouse import Warehouse

Registry = dict[str, Callable[..., Any]]

GROUP_TABLES = (
    "consumed_keys",
    "deliveries",
    "queue_lock",
    "clients",
    "subscription",
    "offsets",
    "group_config",
)
"""Every table holding rows of a consumer group, in the order deleting a group deletes
them: its configuration last."""


class Catalog(Topics):
    """What a warehouse is configured to do, read from and written to its config tables."""

    def __init__(
        self,
        warehouse: Warehouse,
        clock: Clock,
        config: BrokerConfig,
        registered: Catalog | None = None,
    ) -> None:
        """``config``: the configuration of the context this catalog is part of (a context
        and its catalog are made and replaced together: Context.reconfigured).
        ``registered``: the catalog whose in-process registrations this one takes over."""
        super().__init__()
        self.warehouse = warehouse
        self.engine: Engine = warehouse.engine
        self.clock = clock
        self.config = config
        # what this process registered (callables cannot be stored in a table), by group
        self.listeners: Registry = registered.listeners if registered else {}  # push listeners
        self.check_listeners: Registry = registered.check_listeners if registered else {}  # by producer group
        self.sink_transforms: Registry = registered.sink_transforms if registered else {}
        self._max_level: int | None = None
        self._deleted: dict[str, int] = registered._deleted if registered else {}  # created_ts

    def _commit(self, table: str, statement: str) -> None:
        self._commit_attempt(partial(self.engine.execute, statement), table)

    def _commit_attempt(self, attempt: Callable[[], Any], table: str) -> None:
        self.warehouse.commit(attempt, what=table, policy=self.config.commit_policy)

    # --- topics ------------------------------------------------------------------------------
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
        validate_topic_name(name)
        given = queues
        queues = self.config.default_queues if queues is None else queues
        self._upsert_topic(
            name, queues, perm, ordered, create=True, exist_ok=exist_ok, queues_given=given is not None
        )

    def update_topic(
        self, name: str, *, queues: int | None = None, perm: str | None = None, ordered: bool | None = None
    ) -> None:
        validate_topic_name(name)
        info = self._topic(name)
        if info is None:
            raise UnknownTopic(f"topic {name!r} does not exist ({self._existing()})")
        self._upsert_topic(
            name,
            info[0] if queues is None else queues,
            info[1] if perm is None else perm,
            info[2] if ordered is None else ordered,
            create=False,
        )

    def create_system_topic(self, name: str, queues: int) -> None:
        validate_topic_name(name, allow_system=True)
        if self._topic(name) is None:
            self._upsert_topic(name, queues, "RW", False, create=True, exist_ok=True)

    def _upsert_topic(
        self,
        name: str,
        queues: int,
        perm: str,
        ordered: bool,
        *,
        create: bool,
        exist_ok: bool = False,
        queues_given: bool = True,
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
                stored = {"queues": existing[0], "perm": existing[1], "ordered": existing[2]}
                # a default the caller did not choose (the queue count, RW, unordered) is not a setting
                given: dict[str, Any] = {"queues": queues} if queues_given else {}
                given |= {"perm": perm} if perm != Perm.RW.value else {}
                given |= {"ordered": ordered} if ordered else {}
                changed = _changes(stored, given)
                if exist_ok and not changed:
                    return
                if exist_ok:  # not a silent no-op: the settings given are not the topic's
                    raise AlreadyExists(
                        f"topic {name!r} already exists with other settings ({changed}); exist_ok takes "
                        "it only as it is: change it with update_topic (CLI: deltamq topic update)"
                    )
                raise AlreadyExists(f"topic {name!r} already exists ({existing[0]} queues, {existing[1]})")
        now = self.clock.now_ms()
        self._commit(
            "topic_config",
            f"MERGE INTO {self.warehouse.ref('topic_config')} t USING (SELECT {sql_str(name)} AS topic, "
            f"{sql_int(queues)} AS queues, {sql_str(perm)} AS perm, {sql_bool(ordered)} AS ordered, "
            f"{sql_long(now)} AS ts) s ON t.topic = s.topic "
            "WHEN MATCHED THEN UPDATE SET t.queues = s.queues, t.perm = s.perm, t.ordered = s.ordered, "
            "t.updated_ts = s.ts "
            "WHEN NOT MATCHED THEN INSERT (topic, queues, perm, ordered, created_ts, updated_ts) "
            "VALUES (s.topic, s.queues, s.perm, s.ordered, s.ts, s.ts)",
        )
        self._load_topics()

    def require_topic(self, name: str, hint: str = "") -> None:
        """Raise UnknownTopic (naming the topics there are) unless ``name`` exists."""
        validate_topic_name(name)
        if self._topic(name) is None:
            known = ", ".join(sorted(t for t in self._topics if not is_system_topic(t))) or "none"
            raise UnknownTopic(f"topic {name!r} does not exist (topics: {known}){hint}")

    def delete_topic(self, name: str) -> None:
        self.require_topic(name)
        for table in ("subscription", "topic_config"):
            self._commit(table, f"DELETE FROM {self.warehouse.ref(table)} WHERE topic = {sql_str(name)}")
        self._load_topics()

    def max_delay_level(self) -> int:
        """The highest delay level of the warehouse (read once)."""
        if self._max_level is None:
            self._max_level = max((lvl for lvl, _ in self.warehouse.levels()), default=0)
        return self._max_level

    # --- groups ------------------------------------------------------------------------------
    def _rows(self, table: str, columns: str = "*") -> list[dict[str, Any]]:
        """Every row of a settings table: from its files (deltamq/file_reads.py), else
        through the engine."""
        found = file_reads.all_rows(self.warehouse, table, None if columns == "*" else columns.split(", "))
        if found is not None:
            return found
        return [r.asDict() for r in self.engine.rows(f"SELECT {columns} FROM {self.warehouse.ref(table)}")]

    def groups(self) -> dict[str, GroupConfig]:
        """Every consumer group's configuration, by name."""
        rows = sorted(self._rows("group_config"), key=lambda r: r["consumer_group"])
        return {r["consumer_group"]: GroupConfig.from_row(r) for r in rows}

    def group(self, name: str) -> GroupConfig | None:
        return self.groups().get(name)

    def changed(self, groups: Mapping[str, GroupConfig]) -> set[str]:
        """The names in ``groups`` (settings read earlier) deleted since, or deleted and
        created again (another ``created_ts``): a pass that read them must not write
        their positions, keys or send-backs (docs/behaviour.md §3)."""
        if not groups:
            return set()
        now = self.groups()
        return {g for g, cfg in groups.items() if g not in now or now[g].created_ts != cfg.created_ts}

    def require_group(self, name: str, hint: str = "") -> GroupConfig:
        cfg = self.group(validate_group_name(name))
        if cfg is None:
            known = ", ".join(self.groups()) or "none"
            raise UnknownGroup(f"consumer group {name!r} does not exist (groups: {known}){hint}")
        return cfg

    def create_group(
        self,
        cfg: GroupConfig,
        listener: Callable[..., Any] | str | None = None,
        *,
        exist_ok: bool = False,
    ) -> None:
        """Store ``cfg`` (its listener taken from ``listener``: a callable is registered in
        this process, its import path stored when another process could import it); a
        CLUSTERING group gets its retry and dead-letter topics and is subscribed to its
        retry topic."""
        name = cfg.consumer_group
        dedup_key = dedup.validate(self.engine.spark, cfg.dedup_key)
        existing = self.group(name)
        if cfg.mode == "BROADCASTING" and listener is None and not (exist_ok and existing):
            raise ConfigError(
                f"group {name!r}: a BROADCASTING group is consumed by its push listener in each of "
                "its instances; give a listener and instances (pull consumers and sinks take "
                "CLUSTERING groups)"
            )
        if cfg.mode == "BROADCASTING" and dedup_key:
            raise ConfigError(
                f"group {name!r}: dedup_key={dedup_key!r} de-duplicates a CLUSTERING group's consumption "
                "(its keys are the group's, one record per key); each instance of a BROADCASTING "
                "group consumes every message on its own, so one instance's key would skip the "
                "others' messages"
            )
        if cfg.mode == "BROADCASTING" and not cfg.instances:
            raise ConfigError(
                "a BROADCASTING push group delivers to each of its instances: declare them, "
                "e.g. instances=['host-a', 'host-b']"
            )
        if existing is not None and existing.sink_table and listener is not None:
            raise ConfigError(
                f"group {name!r} is the sink into {existing.sink_table}; a push listener needs a group "
                "of its own (create one with another name)"
            )
        registered = self.listeners.get(name)
        cfg = replace(cfg, dedup_key=dedup_key, listener=listener_path(self.listeners, name, listener))
        if existing is not None:
            self._take_existing(existing, cfg, registered, exist_ok)
            return
        row = {
            "consumer_group": sql_str(name),
            **_group_values(cfg),
            # after the deleted one's (within a millisecond, as by a fake clock): the
            # creation time tells a pass's groups from ones created again (changed)
            "created_ts": sql_long(max(self.clock.now_ms(), self._deleted.get(name, -1) + 1)),
            "sink_table": "CAST(NULL AS STRING)",
            "sink_key_columns": "CAST(NULL AS ARRAY<STRING>)",
            "sink_transform": "CAST(NULL AS STRING)",
        }
        select = ", ".join(f"{row[f.name]} AS {f.name}" for f in GROUP_CONFIG.fields)
        self._drop_leftovers(name)
        self._commit(
            "group_config",
            f"MERGE INTO {self.warehouse.ref('group_config')} t USING (SELECT {select}) s "
            "ON t.consumer_group = s.consumer_group WHEN NOT MATCHED THEN INSERT *",
        )
        if cfg.mode == "CLUSTERING":
            self.create_system_topic(retry_topic(name), 1)
            self.create_system_topic(dlq_topic(name), 1)
            # a retry topic that holds messages already is a deleted group's of this name:
            # its retries are not this group's (docs/behaviour.md §3). Its offsets first, so
            # that no tick reads the topic from 0 between the two commits
            left = {
                q: o
                for (t, q), o in consume_queue.load_dispatch_state(self.warehouse).heads.items()
                if t == retry_topic(name) and o > 0
            }
            if left:
                self._init_offsets(cfg, retry_topic(name), left)
            self._subscribe(name, retry_topic(name), "*", "TAG")

    def update_group(
        self, name: str, settings: Mapping[str, Any], listener: Callable[..., Any] | str | None = None
    ) -> dict[str, tuple[Any, Any]]:
        """Change settings of an existing group in place, its offsets kept (RocketMQ's
        ``updateSubGroup``). ``settings``: any of :data:`UPDATABLE`; ``listener``, a push
        group's new listener. Returns ``{setting: (old, new)}`` of what changed. A
        BROADCASTING instance added starts where ``consume_from`` says on every topic the
        group subscribes; one removed loses its offsets."""
        existing = self.require_group(name)
        fixed = sorted(set(settings) - set(UPDATABLE))
        if fixed:
            raise ConfigError(
                f"group {name!r}: {', '.join(fixed)} cannot be changed in place (a group's mode, "
                "ordering, de-duplication key and start are part of what its offsets mean); "
                f"these can: listener, {', '.join(UPDATABLE)}. To change the others, delete the group and "
                "create it again (its offsets and dedup keys go)"
            )
        registry: Registry = {}
        path = existing.listener
        if listener is not None:
            self._check_listener_change(existing)
            path = listener_path(registry, name, listener)
        new = replace(existing, **settings, listener=path)  # validated (ConfigError)
        after = _settings(new)
        changed = {k: (v, after[k]) for k, v in _settings(existing).items() if v != after[k]}
        if listener is not None and not changed.get("listener"):
            changed["listener"] = (existing.listener, path)  # the same path: the callable is new
        added = [i for i in new.instances if i not in existing.instances]
        if added and holds_positions(self.warehouse, name, added):
            # an added instance starts afresh: rows of an earlier instance of the name (a
            # pass that read the settings before its removal may have written some back)
            # are not its positions
            self._commit_attempt(partial(drop_positions, self.warehouse, name, added), "offsets")
        for sub in self.subscriptions(name) if added else []:
            # offsets first (a row of no instance is read by none), of the added ones only: an
            # instance with no row yet reads from 0, and must not be moved past what it missed
            self._init_offsets(new, sub.topic, only=added)
        if changed:
            # only the changed columns: a concurrent update of other settings is kept
            values = _group_values(new)
            sets = ", ".join(f"{k} = {values[k]}" for k in changed)
            ref, where = self.warehouse.ref("group_config"), f"consumer_group = {sql_str(name)}"
            self._commit("group_config", f"UPDATE {ref} SET {sets} WHERE {where}")
        if new.mode == "BROADCASTING" and "instances" in settings:
            # every row of an instance the group no longer has, also one a killed earlier
            # update left behind
            self._commit_attempt(partial(forget_clients, self.warehouse, name, new.instances), "offsets")
        if listener is not None:
            self.listeners.pop(name, None)  # a new import path replaces a callable registered here
        self.listeners.update(registry)
        return changed

    def _check_listener_change(self, existing: GroupConfig) -> None:
        """A new listener replaces a push group's; a sink's or a pull group's is refused."""
        name = existing.consumer_group
        if existing.sink_table:
            raise ConfigError(
                f"group {name!r} is the sink into {existing.sink_table}; a sink has no listener"
            )
        if not existing.listener and name not in self.listeners:
            raise ConfigError(
                f"group {name!r} has no listener stored: it is a pull group (its clients consume it) "
                "or a push group whose callable was registered in another process only. A pull "
                "group cannot become a push group in place; create a push group of its own"
            )

    def _take_existing(
        self, existing: GroupConfig, cfg: GroupConfig, registered: Callable[..., Any] | None, exist_ok: bool
    ) -> None:
        """``create_group`` of a group that exists: with ``exist_ok`` and the same settings,
        nothing to do; else AlreadyExists (naming the settings that differ), and a callable
        given for it is not registered."""
        name = existing.consumer_group
        given = _settings(cfg)
        if cfg.listener is None:  # none given: the stored one stands (a pull group has none either)
            given.pop("listener")
        changed = _changes(_settings(existing), given)
        if exist_ok and not changed:
            return
        if registered is None:
            self.listeners.pop(name, None)
        else:
            self.listeners[name] = registered
        if exist_ok:  # not a silent no-op: the settings given are not the group's
            raise AlreadyExists(
                f"consumer group {name!r} already exists with other settings ({changed}); exist_ok "
                "takes it only as it is. To change them: update_group (CLI: group update), its "
                "offsets kept; for the mode, ordering, dedup_key or consume_from, delete it and create "
                "it again (delete_group(force=True), CLI: group delete --force; its offsets and dedup "
                "keys go)"
            )
        raise AlreadyExists(f"consumer group {name!r} already exists")

    def delete_group(self, name: str) -> None:
        """Delete every row of group ``name``: its consumed dedup keys and its pull clients'
        log, locks and registrations first (a group created again under the name starts
        afresh, from its ``consume_from``), its configuration last (a delete that stops
        half-way leaves the group there, to be deleted again)."""
        self._deleted[name] = self.require_group(name).created_ts or 0
        for table in GROUP_TABLES:
            self._drop_rows(table, name)
        self.listeners.pop(name, None)

    def _drop_leftovers(self, name: str) -> None:
        """Rows under a name no group has, written after its delete by a deliver,
        retention or fold pass or a pull client that read the deleted group (positions,
        consumed keys, a pull client's log, locks and registration): dropped before a group
        of the name is created, which starts where its consume_from says, skips no message
        by an old key, and is not kept out by an old lock (docs/behaviour.md §3)."""
        for table in GROUP_TABLES:
            if table not in ("subscription", "group_config") and self._holds_rows(table, name):
                self._drop_rows(table, name)

    def _drop_rows(self, table: str, group: str) -> None:
        self._commit(
            table, f"DELETE FROM {self.warehouse.ref(table)} WHERE consumer_group = {sql_str(group)}"
        )

    def _holds_rows(self, table: str, group: str) -> bool:
        """Whether ``table`` has a row of ``group``."""
        found = file_reads.holds(self.warehouse, table, "consumer_group", group)
        if found is not None:
            return found
        where = f"consumer_group = {sql_str(group)}"
        return bool(self.engine.rows(f"SELECT 1 FROM {self.warehouse.ref(table)} WHERE {where} LIMIT 1"))

    def set_sink(self, group: str, table: str, keys: Sequence[str], transform_path: str | None) -> None:
        """Store a group's exactly-once sink (validated by :mod:`deltamq.jobs.sink`)."""
        keys_sql = "array(" + ", ".join(sql_str(k) for k in keys) + ")"
        self._commit(
            "group_config",
            f"UPDATE {self.warehouse.ref('group_config')} SET sink_table = {sql_str(table)}, "
            f"sink_key_columns = {keys_sql}, sink_transform = {sql_str(transform_path)} "
            f"WHERE consumer_group = {sql_str(group)}",
        )

    # --- subscriptions -----------------------------------------------------------------------
    def subscribe(self, group: str, topic: str, expression: str = "*", expr_type: str = "TAG") -> None:
        validate_group_name(group)
        validate_topic_name(topic, allow_system=True)
        if is_system_topic(topic) and not topic.startswith(DLQ_PREFIX):
            raise SystemTopicError(
                f"topic {topic!r} is internal to the engine (delayed, half or retry copies); a "
                f"group may subscribe to user topics and to dead-letter topics ({DLQ_PREFIX}<group>)"
            )
        cfg = self.require_group(group, "; create it first")
        if self._topic(topic) is None:
            raise UnknownTopic(f"topic {topic!r} does not exist ({self._existing()}); create it first")
        expression = validate_expression(expression, expr_type)
        # where the group starts first: a tick (or retention) between the two commits would
        # otherwise read a subscription without offsets, from offset 0 whatever consume_from
        self._init_offsets(cfg, topic)
        self._subscribe(group, topic, expression, expr_type)

    def _subscribe(self, group: str, topic: str, expression: str, expr_type: str) -> None:
        if expr_type not in EXPRESSION_TYPES:
            raise ConfigError(f"type={expr_type!r} is not allowed; use one of {EXPRESSION_TYPES}")
        self._commit(
            "subscription",
            f"MERGE INTO {self.warehouse.ref('subscription')} t USING (SELECT "
            f"{sql_str(group)} AS consumer_group, {sql_str(topic)} AS topic, "
            f"{sql_str(expr_type)} AS expr_type, {sql_str(expression)} AS expression, "
            f"{sql_long(self.clock.now_ms())} AS created_ts) s "
            "ON t.consumer_group = s.consumer_group AND t.topic = s.topic "
            "WHEN MATCHED THEN UPDATE SET t.expr_type = s.expr_type, t.expression = s.expression "
            "WHEN NOT MATCHED THEN INSERT *",
        )

    def unsubscribe(self, group: str, topic: str) -> None:
        """Remove ``group``'s subscription to ``topic``; its offsets stay (a later
        subscription goes on from them, as in RocketMQ)."""
        self.require_group(group)
        if topic.startswith(RETRY_PREFIX):
            raise SystemTopicError(
                f"{topic!r} is group {group!r}'s own retry topic: it goes with the group (group delete)"
            )
        mine = [s.topic for s in self.subscriptions(group)]
        if topic not in mine:
            raise ConfigError(
                f"group {group!r} does not subscribe to topic {topic!r}; it subscribes to "
                f"{', '.join(repr(t) for t in mine) or 'nothing'}"
            )
        self._commit(
            "subscription",
            f"DELETE FROM {self.warehouse.ref('subscription')} "
            f"WHERE consumer_group = {sql_str(group)} AND topic = {sql_str(topic)}",
        )

    def subscriptions(self, group: str | None = None) -> list[Subscription]:
        rows = self._rows("subscription", "consumer_group, topic, expr_type, expression")
        chosen = [r for r in rows if group is None or r["consumer_group"] == group]
        chosen.sort(key=lambda r: (r["consumer_group"], r["topic"]))
        return [Subscription.from_row(r) for r in chosen]

    def _start_offsets(self, topic: str, mode: ConsumeFrom, timestamp: int | None) -> dict[int, int]:
        """Per queue of ``topic``: where LAST_OFFSET / FIRST_OFFSET / TIMESTAMP starts. The
        heads are those consumers see now: a copy promoted ahead and not due yet is after
        LAST_OFFSET, as it would be had it been promoted at its due time."""
        visible = visible_heads(self.warehouse, self.clock.now_ms())
        heads = {q: o for (t, q), o in visible.items() if t == topic}
        if not heads:
            return {}
        if mode == "FIRST_OFFSET":
            # the oldest message retention left (RocketMQ's min offset), not offset 0: a queue
            # it trimmed would otherwise be walked through offsets that are gone; one it
            # emptied starts at its head
            lows = consume_queue.minimums(self.warehouse, topic)
            return {q: lows.get((topic, q), head) for q, head in heads.items()}
        if mode == "LAST_OFFSET":
            return heads
        stored = (
            {} if timestamp is None else consume_queue.minimums(self.warehouse, topic, stored_from=timestamp)
        )
        firsts = {q: lo for (_, q), lo in stored.items()}
        return {q: firsts.get(q, head) for q, head in heads.items()}

    def _init_offsets(
        self,
        cfg: GroupConfig,
        topic: str,
        starts: dict[int, int] | None = None,
        only: Sequence[str] | None = None,
    ) -> None:
        """Decide where a group starts on a topic, once, when it first subscribes
        (docs/behaviour.md §3): at ``starts``, or where its ``consume_from`` says. Queues
        that appear later start at 0 (no row); retry queues start at 0, or past the retries
        a deleted group of the same name left."""
        placed = clients_with_offsets(self.warehouse, cfg.name, topic)
        # a BROADCASTING instance left unplaced (by a release that placed them one commit
        # each, killed between two) starts where the setting says, not at offset 0
        missing = [c for c in (cfg.clients if only is None else only) if c not in placed]
        if not missing:
            return
        if starts is None:
            starts = self._start_offsets(topic, cfg.consume_from, cfg.consume_timestamp)
        self._commit_attempt(
            partial(start_positions, self.warehouse, cfg.name, missing, topic, starts, self.clock.now_ms()),
            "offsets",
        )

    def offsets_at(self, group: str, to_time: int) -> dict[tuple[str, int], int]:
        """Per queue of every topic ``group`` subscribes: the offset of the first message
        stored at or after ``to_time`` (epoch ms), where :meth:`set_offsets` moves it."""
        self.require_group(group)
        new: dict[tuple[str, int], int] = {}
        for sub in self.subscriptions(group):
            for q, o in self._start_offsets(sub.topic, "TIMESTAMP", to_time).items():
                new[(sub.topic, q)] = o
        return new

    def reset_offsets(self, group: str, to_time: int) -> dict[tuple[str, int], int]:
        """:meth:`offsets_at` then :meth:`set_offsets`: the offsets alone (a push group's
        or a sink's reset; ``Broker.reset_offsets`` also restarts a pull group's clients)."""
        new = self.offsets_at(group, to_time)
        self.set_offsets(group, new)
        return new

    def set_offsets(self, group: str, new: dict[tuple[str, int], int]) -> None:
        """Move the group's offsets to ``new``, back or forward (an offset reset): a
        BROADCASTING group's, each of its instances'."""
        merge = OffsetsMerge(("next_offset",), self.clock.now_ms())
        for client in self.require_group(group).clients:
            for (t, q), o in sorted(new.items()):
                merge.add(group, t, q, client, next_offset=o)
        update = {
            "next_offset": source("next_offset"),
            # a pull group's hand-out position starts at the new offset too (it is
            # next_offset where this is null: docs/behaviour.md §6)
            "delivered_offset": "CAST(NULL AS BIGINT)",
            **fresh_head(),
        }
        insert = {"next_offset": source("next_offset"), "attempts": "0"}
        self._commit_attempt(partial(merge.execute, self.warehouse, update, insert), "offsets")

    # --- producer groups: transaction check-back ---------------------------------------------
    def set_check_listener(self, producer_group: str, listener: Callable[..., Any] | str) -> None:
        """Answer the group's check-back with ``listener`` (docs/behaviour.md §5)."""
        path = listener_path(self.check_listeners, producer_group, listener, "check listener")
        self._set_check(producer_group, listener=path)

    def set_check_table(self, cfg: CheckConfig) -> None:
        """Answer the group's check-back from a Delta table of local state."""
        validate_table_check(self.engine.spark, cfg)
        self.check_listeners.pop(cfg.group, None)
        self._set_check(
            cfg.group,
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
        source_row = (
            f"SELECT {sql_str(group)} AS producer_group, {sql_str(listener)} AS check_listener, "
            f"{sql_str(table)} AS check_table, {sql_str(key_property)} AS check_key_property, "
            f"{sql_str(key_column)} AS check_key_column, "
            f"{sql_str(state_expression)} AS check_state_expression, "
            f"{sql_long(self.clock.now_ms())} AS updated_ts"
        )
        self._commit(
            "producer_config",
            f"MERGE INTO {self.warehouse.ref('producer_config')} t USING ({source_row}) s "
            "ON t.producer_group = s.producer_group "
            "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *",
        )

    def check_configs(self) -> dict[str, CheckConfig]:
        """Per producer group, how check-back is answered, from ``producer_config`` plus the
        check listeners registered in this process."""
        out: dict[str, CheckConfig] = {}
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


def new_group_config(
    name: str,
    *,
    mode: MessageModel = "CLUSTERING",
    orderly: bool = False,
    max_reconsume_times: int | None = None,
    **settings: Any,
) -> GroupConfig:
    """A validated :class:`GroupConfig` for a new group; an orderly group retries without
    limit unless told otherwise (docs/behaviour.md §4)."""
    if max_reconsume_times is None:
        max_reconsume_times = -1 if orderly else 16
    return GroupConfig(name, mode=mode, orderly=orderly, max_reconsume_times=max_reconsume_times, **settings)


_SETTINGS = (
    "mode",
    "orderly",
    "max_reconsume_times",
    "pull_batch_size",
    "consume_batch_size",
    "consume_from",
    "consume_timestamp",
    "consume_timeout_ms",
    "dedup_key",
    "listener",
    "retry_policy",
    "instances",
    "invisible_time_ms",
    "dedup_window_ms",
)
"""What ``create_group`` sets (a sink is set by ``sink_to_table``, the creation time by the store)."""


UPDATABLE = (
    "max_reconsume_times",
    "pull_batch_size",
    "consume_batch_size",
    "consume_timeout_ms",
    "retry_policy",
    "instances",
    "invisible_time_ms",
    "dedup_window_ms",
)
"""What ``update_group`` changes in place, beside a push group's listener (an argument of
its own)."""


def _group_values(cfg: GroupConfig) -> dict[str, str]:
    """SQL literals of a group's settings as ``group_config`` stores them, by column."""
    policy = json.dumps(dict(cfg.retry_policy)) if cfg.retry_policy else None
    inst = "CAST(NULL AS ARRAY<STRING>)"
    if cfg.instances:
        inst = "array(" + ", ".join(sql_str(i) for i in cfg.instances) + ")"
    return {
        "mode": sql_str(cfg.mode),
        "orderly": sql_bool(cfg.orderly),
        "max_reconsume_times": sql_int(cfg.max_reconsume_times),
        "pull_batch_size": sql_int(cfg.pull_batch_size),
        "consume_batch_size": sql_int(cfg.consume_batch_size),
        "consume_from": sql_str(cfg.consume_from),
        "consume_timestamp": sql_long(cfg.consume_timestamp),
        "consume_timeout_ms": sql_long(cfg.consume_timeout_ms),
        "dedup_key": sql_str(cfg.dedup_key),
        "listener": sql_str(cfg.listener),
        "retry_policy": sql_str(policy),
        "instances": inst,
        "invisible_time_ms": sql_long(cfg.invisible_time_ms),
        "dedup_window_ms": sql_long(cfg.dedup_window_ms),
    }


def _settings(cfg: GroupConfig) -> dict[str, Any]:
    out = {k: getattr(cfg, k) for k in _SETTINGS}
    out["retry_policy"] = json.dumps(dict(cfg.retry_policy), sort_keys=True) if cfg.retry_policy else None
    out["instances"] = tuple(cfg.instances or ())
    return out


def _changes(stored: dict[str, Any], given: dict[str, Any]) -> str:
    """The settings ``given`` that differ from those ``stored``, in words ('' for none)."""
    return ", ".join(f"{k}: {stored[k]!r} stored, {v!r} given" for k, v in given.items() if stored[k] != v)


def listener_path(
    registry: Registry, group: str, listener: Callable[..., Any] | str | None, what: str = "listener"
) -> str | None:
    """The import path to store for ``listener``; a callable is also kept in ``registry``
    for this process (its path is stored only when another process could import it). An
    import path is imported here first: one that cannot be is refused now
    (ListenerUnavailable), not found out message by message at delivery."""
    if listener is None:
        return None
    if isinstance(listener, str):
        module, sep, attr = listener.partition(":")
        if not sep or not module or not attr:
            raise ConfigError(f"{what} {listener!r} is not an import path; use 'package.module:function'")
        resolve_listener(listener, what)
        return listener
    if not callable(listener):
        raise ConfigError(f"{what} {listener!r} is neither a callable nor an import path")
    registry[group] = listener
    owner = inspect.getmodule(listener)
    qualname = getattr(listener, "__qualname__", None)  # an object with __call__ has none
    if owner is None or qualname is None or "<" in qualname or owner.__name__ == "__main__":
        # in-process only: jobs started elsewhere cannot import it; they say so (exit 4)
        name = qualname or f"{type(listener).__qualname__} object"
        where = f"{owner.__name__ if owner else '?'}:{name}"
        elsewhere = (
            "they fail, naming the group"
            if what == "listener"
            else "they log that they cannot import it and answer UNKNOWN"
        )
        warnings.warn(
            f"{what} {where} of {group!r} is a callable that exists only in this process: "
            "jobs run here use it, but `deltamq tick`, Airflow and spark-submit cannot "
            f"({elsewhere}); give an import path 'package.module:function' to run it anywhere",
            InProcessListener,
            stacklevel=4,
        )
        return IN_PROCESS + where
    return f"{owner.__name__}:{qualname}"
