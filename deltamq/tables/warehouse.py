"""The warehouse: one directory (or URI) holding every deltamq table.

``Warehouse.init`` creates any missing table idempotently, seeds the delay levels,
and upgrades a warehouse of an older schema version in place (creates the tables
and adds the columns introduced since; see ``deltamq/schemas``). A warehouse of a
newer schema version than this release is refused rather than half-understood.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from deltamq import file_reads
from deltamq.config import TOMBSTONE_RETENTION, BrokerConfig, CommitPolicy, parse_levels, tombstone_retention
from deltamq.constants import COMMIT_LOG_GROUPS
from deltamq.delta_append import BlindAppender, Unsupported, Written, plain_writer
from deltamq.delta_read import FileSnapshot
from deltamq.errors import ConfigError, SchemaVersionError, WarehouseNotFound
from deltamq.schemas import SCHEMA_VERSION, TABLES, TableSpec
from deltamq.storage import Storage, merge_rows_into, normalize_location
from deltamq.tables.sqltext import sql_str
from deltamq.tables.views import VIEWS, needed

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from deltamq.engine import Engine

R = TypeVar("R")
log = logging.getLogger(__name__)

__all__ = ["Warehouse", "normalize_location"]


MERGE_CHECKPOINT_EVERY = 10
"""A table :meth:`Warehouse.merge_rows` writes gets a checkpoint every this many versions
(Delta's default interval, as Sail writes them)."""


OUTSIDE_THE_ENGINE = frozenset({"job_runs"})
"""Tables appended to without the engine even by Apache Spark on a local disk: after
``init`` created them, the engine never commits to them (the tick runner appends, and
retention deletes and compaction rewrites, through deltamq's appender and delta-rs, whose
commits are atomic for every writer), so Spark's check-then-rename commit has no other
writer's entry to overwrite (docs/engines.md). A busy tick on Apache Spark saves a ~0.5 s
commit. ``init``'s schema upgrades go through the engine: tick runners stopped."""

SEEDED = frozenset({"consume_queue"})
"""Tables whose appends this process makes are kept decoded in its snapshot of them: the
index dispatch writes is the one deliver takes next (1M rows: 0.1 s of decoding saved)."""


class Warehouse:
    """Locations and SQL references of every table of one warehouse.

    ``storage`` (deltamq/storage.py) is the one way to the files: built from the
    location and ``storage_options`` unless given. The engine is prepared for it (the
    embedded server's environment, classic Spark's ``fs.s3a`` settings). A warehouse
    holds no broker configuration: what a call needs (commit retries, delay levels)
    comes with the call.
    """

    def __init__(
        self,
        engine: Engine,
        location: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, str] | None = None,
        storage: Storage | None = None,
    ) -> None:
        self.engine = engine
        self.storage = storage or Storage(location, storage_options or {})
        self.location = self.storage.location
        # a missing bucket, no or rejected credentials, an unreachable endpoint: said here
        self.storage.check_reachable()
        engine.prepare_storage(self.storage)
        self._known: set[str] = set()
        self._appenders: dict[str, BlindAppender | None] = {}
        self._snapshots: dict[str, FileSnapshot | None] = {}
        self._merged: dict[str, Any] = {}  # delta-rs tables kept for merge_rows (None: the engine's)
        self._checkpointed: dict[str, int] = {}  # per table merge_rows writes: version of its last checkpoint
        # Apache Spark commits on a local disk by check-then-rename (docs/engines.md), atomic
        # only among its own threads: there every commit goes through the engine
        self._appends_outside = not (engine.flavor == "spark" and self.storage.is_local)

    @property
    def is_local(self) -> bool:
        return self.storage.is_local

    def uri(self, table: str) -> str:
        """A table's location as the storage seam and delta-rs name it."""
        TABLES[table]  # KeyError for an unknown table
        return self.storage.join(table)

    def path(self, table: str) -> str:
        """A table's location as the engine reads it (``s3a://`` for classic Spark)."""
        return self.storage.engine_path(self.uri(table), self.engine.hadoop_paths)

    def engine_path(self, uri: str) -> str:
        """Any file or table URI of this warehouse as the engine reads it."""
        return self.storage.engine_path(uri, self.engine.hadoop_paths)

    def ref(self, table: str) -> str:
        """SQL reference of a table: delta.`<location>/<table>`."""
        return f"delta.`{self.path(table)}`"

    def delta_rs(self, table: str) -> Any:
        """The delta-rs ``DeltaTable`` of one of the tables (maintenance the engines lack:
        deletes beside appending producers, compaction, vacuum, checkpoints)."""
        return self.storage.delta_table(self.uri(table))

    def read(self, table: str) -> DataFrame:
        return self.engine.spark.read.format("delta").load(self.path(table))

    def append(self, table: str, df: DataFrame, *, once: tuple[str, int] | None = None) -> None:
        """The engine's blind append of ``df`` to ``table`` (``once``: Engine.append's)."""
        spec = TABLES[table]
        columns = df.select(*spec.schema.fieldNames())
        self.engine.append(columns, self.path(table), spec.partition_by, once=once)

    def append_arrow(self, table: str, rows: pa.Table) -> None:
        """A blind append of rows built in Python (the producers' messages, pull clients'
        deliveries, a tick's records), written without an engine round trip: a Parquet
        file and a commit entry put-if-absent (deltamq/delta_append.py; a lost answer to
        the commit is recognised as its own). A table whose protocol that writer does not
        meet is appended to by the engine, as is every table when the engine is Apache
        Spark on a local disk, except those the engine never commits to after creating
        them (:data:`OUTSIDE_THE_ENGINE`)."""
        appender = self.arrow_appender(table)
        if appender is not None:
            try:
                appender.append(rows)
                return
            except Unsupported:
                self._appenders[table] = None  # from now on through the engine
        self.append(table, self.engine.spark.createDataFrame(rows))

    def _seeder(self, table: str) -> Callable[[list[Written]], None]:
        def seed(written: list[Written]) -> None:
            snap = self._snapshots.get(table)
            if snap is not None:
                snap.seed(written)

        return seed

    def arrow_appender(self, table: str) -> BlindAppender | None:
        """The table's writer of rows built in Python (deltamq/delta_append.py), its table
        read once; None when the engine must write the table (Apache Spark on a local
        disk, or a protocol that writer does not meet)."""
        if table not in self._appenders:
            groups = COMMIT_LOG_GROUPS if table == "commit_log" else ()
            self._appenders[table] = (
                BlindAppender(
                    self.storage,
                    self.uri(table),
                    engine_info="deltamq",
                    group_by=groups,
                    # the index dispatch writes is what deliver reads next: kept decoded
                    on_written=self._seeder(table) if table in SEEDED else None,
                )
                if self._appends_outside or table in OUTSIDE_THE_ENGINE
                else None
            )
        appender = self._appenders[table]
        if appender is not None:
            try:
                appender.ready()
            except Unsupported:
                self._appenders[table] = appender = None  # from now on through the engine
        return appender

    def merge_rows(
        self,
        table: str,
        source: pa.Table,
        on: str,
        update: Mapping[str, str],
        insert: Mapping[str, str] | None,
    ) -> bool:
        """A ``MERGE`` of a few rows built in Python (``source``, aliased ``s``) into
        ``table`` (aliased ``t``) with delta-rs instead of an engine statement: a small
        control table is rewritten in a few milliseconds where the engine's ``MERGE``
        takes tens. ``update`` and ``insert`` map columns to SQL expressions (None: no
        insert). False when the engine must do it (Apache Spark on a local disk, as for
        :meth:`append_arrow`; a protocol asking for more than plain files, such as deletion
        vectors), and nothing was written.
        A commit refused by a concurrent writer raises delta-rs' ``CommitFailedError``
        (``engine.is_commit_conflict``): the caller's ``Context.commit`` runs it again."""
        if not self._appends_outside or (table in self._merged and self._merged[table] is None):
            return False
        dt = self._merged.get(table)
        if dt is None:
            dt = self.storage.delta_table(self.uri(table))
            if not plain_writer(dt.protocol()):  # e.g. deletion vectors: the engine honours them
                self._merged[table] = None
                return False
            self._merged[table] = dt
        else:
            dt.update_incremental()
        from deltalake import PostCommitHookProperties

        hooks = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
        merge = merge_rows_into(dt, source, on, post_commithook_properties=hooks)
        merge = merge.when_matched_update(dict(update))
        if insert is not None:
            merge = merge.when_not_matched_insert(dict(insert))
        merge.execute()
        version, last = dt.version(), self._checkpointed.setdefault(table, dt.version() - 1)
        if version // MERGE_CHECKPOINT_EVERY > last // MERGE_CHECKPOINT_EVERY:
            # as the engine's writers do: readers start from the newest checkpoint, and log
            # cleanup removes only entries below one (jobs/compact.py)
            dt.create_checkpoint()
            self._checkpointed[table] = version
        return True

    def known_versions(self) -> dict[str, int]:
        """Per table, the latest version this process has read (its snapshot) or committed
        (its appenders, its delta-rs MERGEs): a version each table has at least, from which
        a look for newer commits can start."""
        known: dict[str, int] = {}

        def saw(table: str, version: int | None) -> None:
            if version is not None and version >= 0:
                known[table] = max(known.get(table, -1), version)

        for table, snap in self._snapshots.items():
            saw(table, snap.version if snap is not None else None)
        for table, appender in self._appenders.items():
            saw(table, appender.version if appender is not None else None)
        for table, dt in self._merged.items():
            saw(table, dt.version() if dt is not None else None)
        return known

    def snapshot(self, table: str) -> FileSnapshot | None:
        """The table's files as of now, for reads without an engine round trip
        (deltamq/delta_read.py): kept between calls and brought up to date from the new
        log entries. None for a table whose protocol that reader does not meet: read it
        with the engine."""
        if table not in self._snapshots:
            self._snapshots[table] = FileSnapshot(self.storage, self.uri(table))
        snap = self._snapshots[table]
        if snap is not None:
            try:
                snap.refresh()
            except Unsupported:
                self._snapshots[table] = snap = None  # from now on through the engine
        return snap

    # --- existence and creation ---------------------------------------------------------
    def table_exists(self, table: str) -> bool:
        """Whether the table has a Delta log. A store that cannot be listed (no bucket,
        no credentials, …) raises StorageError naming the location and the cause."""
        return self.storage.is_delta_table(self.uri(table))

    def table_columns(self, table: str) -> list[str]:
        return self.read(table).schema.fieldNames()

    def commit(self, attempt: Callable[[], R], *, what: str, policy: CommitPolicy) -> R:
        """``attempt`` committed by the engine (retried on conflicts and store faults as
        ``policy`` says); a store fault that outlasts the retries is a StorageError
        naming this warehouse and the cause."""
        named = partial(self.store_error, what)
        return self.engine.commit(attempt, what=what, policy=policy, store_error=named)

    def store_error(self, what: str, error: BaseException) -> Exception:
        """A StorageError: committing ``what`` to this warehouse failed, with the cause."""
        return self.storage.error(f"commit {what} to the warehouse at", self.location, error)

    def _commit(self, attempt: Callable[[], None], what: str, config: BrokerConfig) -> None:
        self.commit(attempt, what=what, policy=config.commit_policy)

    def _create(self, spec: TableSpec, version: int, config: BrokerConfig) -> None:
        schema = spec.columns_at(version)
        empty = self.engine.spark.createDataFrame([], schema)
        # checkpoints keep remove tombstones only this long (jobs/compact.py)
        properties = {TOMBSTONE_RETENTION: tombstone_retention(config)} | spec.properties

        def attempt() -> None:
            if self.table_exists(spec.name):
                return
            self.engine.append(empty, self.path(spec.name), spec.partitioning_at(version), properties)

        self._commit(attempt, f"create {spec.name}", config)

    def _repartition(self, spec: TableSpec, version: int, config: BrokerConfig) -> None:
        """Rewrite a table whose partitioning changes at ``version`` in its new layout, in
        one overwrite commit (a control table of a few rows: they are read whole first, so
        the write never reads the table it replaces). A writer committing between that read
        and the start of the overwrite's commit would be undone by it (docs/design.md,
        "Tables"): run ``init`` with pull clients stopped."""
        schema = spec.columns_at(version)
        log.warning(
            "rewriting %s partitioned by %s: a pull client writing it meanwhile would be undone",
            self.uri(spec.name),
            ", ".join(spec.partition_by),
        )

        def attempt() -> None:
            rows = self.read(spec.name).select(*schema.fieldNames()).collect()
            data = self.engine.spark.createDataFrame(rows, schema)
            writer = data.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
            writer.partitionBy(*spec.partitioning_at(version)).save(self.path(spec.name))

        self._commit(attempt, f"upgrade {spec.name} (partitioned by {', '.join(spec.partition_by)})", config)

    def _add_columns(self, spec: TableSpec, version: int, config: BrokerConfig) -> list[str]:
        have = set(self.table_columns(spec.name))
        wanted = spec.columns_at(version)
        missing = [f.name for f in wanted.fields if f.name not in have]
        if not missing:
            return []
        # Sail has no ALTER TABLE ADD COLUMNS: a schema-merging append of zero rows adds
        # nullable columns on every engine (docs/engines.md).
        empty = self.engine.spark.createDataFrame([], wanted)
        writer = empty.write.format("delta").mode("append").option("mergeSchema", "true")
        self._commit(lambda: writer.save(self.path(spec.name)), f"upgrade {spec.name}", config)
        return missing

    # --- init / upgrade --------------------------------------------------------------------
    def schema_version(self) -> int | None:
        """The schema version recorded in the warehouse, None for an empty location."""
        if not self.table_exists("warehouse_meta"):
            return None
        rows = self.engine.rows(
            f"SELECT value FROM {self.ref('warehouse_meta')} WHERE key = 'schema_version'"
        )
        return int(rows[0]["value"]) if rows else None

    def init(
        self, levels: str | None = None, *, config: BrokerConfig, target_version: int = SCHEMA_VERSION
    ) -> dict[str, Any]:
        """Create missing tables, upgrade older ones, seed levels (``levels``, else
        ``config.delay_levels`` on a new warehouse). Idempotent.

        Returns what was done: ``{"created": [...], "upgraded": {...}, "from_version": v}``.
        """
        if target_version > SCHEMA_VERSION or target_version < 1:
            raise ConfigError(
                f"target_version={target_version} is not one this release can write (1..{SCHEMA_VERSION})"
            )
        current = self.schema_version()
        if current is not None and current > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"warehouse {self.location} has schema version {current}, newer than this "
                f"release's {SCHEMA_VERSION}; upgrade deltamq instead of downgrading the warehouse"
            )
        if current is not None and current > target_version:
            raise SchemaVersionError(
                f"warehouse {self.location} is at schema version {current}; "
                f"cannot init it at {target_version}"
            )
        seeded = self._planned_levels(levels, config)  # refused before anything is written
        created: list[str] = []
        upgraded: dict[str, list[str]] = {}
        for spec in TABLES.values():
            if spec.added_in > target_version:
                continue
            if not self.table_exists(spec.name):
                self._create(spec, target_version, config)
                created.append(spec.name)
            elif current is None or current < target_version:
                added = self._add_columns(spec, target_version, config)
                if (current or 0) < spec.partitioned_in <= target_version and spec.partitioned_in > 1:
                    self._repartition(spec, target_version, config)
                    added.append(f"partitioned by {', '.join(spec.partition_by)}")
                if added:
                    upgraded[spec.name] = added
        if seeded is not None:
            self._seed_levels(seeded, config)
        if current != target_version:
            self._set_meta("schema_version", str(target_version), config)
        self._known = set(TABLES)
        return {
            "created": created,
            "upgraded": upgraded,
            "from_version": current,
            "levels": None if seeded is None else " ".join(label for _, _, label in seeded),
        }

    def _planned_levels(self, levels: str | None, config: BrokerConfig) -> list[tuple[int, int, str]] | None:
        """The delay levels ``init`` writes: ``levels`` (else the configured ones on a
        warehouse without any), or None when the stored ones stay. A warehouse keeps every
        level it has: a message held at a level that is gone would wait in its queue for
        ever, so fewer levels than stored are refused (delays may change, levels may be
        added)."""
        existing = self.levels() if self.table_exists("schedule_levels") else []
        if existing and levels is None:
            return None
        parsed = parse_levels(levels or config.delay_levels)
        if existing and [(lvl, ms) for lvl, ms, _ in parsed] == existing:
            return None
        if len(parsed) < len(existing):
            raise ConfigError(
                f"levels={levels!r} has {len(parsed)} delay levels; warehouse {self.location} has "
                f"{len(existing)}, and a message held at a removed level would never be delivered. "
                "Give at least as many (a level's delay may change; levels may be added)"
            )
        return parsed

    def _set_meta(self, key: str, value: str, config: BrokerConfig) -> None:
        statement = (
            f"MERGE INTO {self.ref('warehouse_meta')} t "
            f"USING (SELECT {sql_str(key)} AS key, {sql_str(value)} AS value, "
            f"CAST({int(time.time() * 1000)} AS BIGINT) AS updated_ts) s ON t.key = s.key "
            "WHEN MATCHED THEN UPDATE SET t.value = s.value, t.updated_ts = s.updated_ts "
            "WHEN NOT MATCHED THEN INSERT (key, value, updated_ts) VALUES (s.key, s.value, s.updated_ts)"
        )
        self._commit(lambda: self.engine.execute(statement), "warehouse_meta", config)

    def _seed_levels(self, parsed: list[tuple[int, int, str]], config: BrokerConfig) -> None:
        values = ", ".join(f"({lvl}, CAST({ms} AS BIGINT), {sql_str(label)})" for lvl, ms, label in parsed)
        statement = (
            f"MERGE INTO {self.ref('schedule_levels')} t "
            f"USING (SELECT * FROM VALUES {values} AS v(level, delay_ms, label)) s "
            "ON t.level = s.level "
            "WHEN MATCHED AND (t.delay_ms <> s.delay_ms OR t.label <> s.label) "
            "THEN UPDATE SET t.delay_ms = s.delay_ms, t.label = s.label "
            "WHEN NOT MATCHED THEN INSERT (level, delay_ms, label) VALUES (s.level, s.delay_ms, s.label) "
            "WHEN NOT MATCHED BY SOURCE THEN DELETE"
        )
        self._commit(lambda: self.engine.execute(statement), "schedule_levels", config)

    def levels(self) -> list[tuple[int, int]]:
        """(level, delay_ms) rows of ``schedule_levels``, by level."""
        found = file_reads.all_rows(self, "schedule_levels", ["level", "delay_ms"])
        rows: list[Any] = (
            found
            if found is not None
            else self.engine.rows(f"SELECT level, delay_ms FROM {self.ref('schedule_levels')}")
        )
        return sorted((r["level"], r["delay_ms"]) for r in rows)

    def ensure_ready(self) -> None:
        """Raise unless the warehouse was initialised at this release's schema version."""
        version = self.schema_version()
        if version is None:
            raise WarehouseNotFound(
                f"no deltamq warehouse at {self.location} (nothing was created); check the "
                f"location, or create one with `deltamq init --warehouse {self.location}` or "
                f"Broker.init({self.location!r})"
            )
        if version == SCHEMA_VERSION:
            self._known = set(TABLES)  # every table exists: views need no listing
            return
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"warehouse {self.location} has schema version {version}, this release needs "
                f"{SCHEMA_VERSION}; run `deltamq init` to upgrade"
                if version < SCHEMA_VERSION
                else f"warehouse {self.location} has schema version {version}, newer than this "
                f"release's {SCHEMA_VERSION}; upgrade deltamq"
            )

    def catalog_statements(self, database: str) -> list[str]:
        """The SQL that registers every table of the warehouse as an external Delta table
        ``database.<table>`` and the views for SQL users as ``database.<view>``."""
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", database):
            raise ConfigError(
                f"database={database!r} is not allowed: letters, digits and _, not starting with a digit"
            )
        out = [f"CREATE DATABASE IF NOT EXISTS {database}"]
        for name in TABLES:
            # an existing table of that name is kept as it is: nothing here drops anything
            location = sql_str(self.path(name))
            out.append(f"CREATE TABLE IF NOT EXISTS {database}.{name} USING delta LOCATION {location}")
        for view, text in VIEWS.items():
            out.append(f"CREATE OR REPLACE VIEW {database}.{view} AS {text(lambda t: f'{database}.{t}')}")
        return out

    def register_catalog(self, database: str) -> list[str]:
        """Register the tables and views under ``database`` in the engine's session catalog
        (persistent where the catalog is, e.g. a Hive metastore); returns the names."""
        self.ensure_ready()
        for statement in self.catalog_statements(database):
            self.engine.execute(statement)
        return [f"{database}.{name}" for name in (*TABLES, *VIEWS)]

    def register_views(self, query: str | None = None) -> None:
        """Register each table as a temp view named after it, at its newest version, and
        the views for SQL users over them (:mod:`deltamq.tables.views`): those ``query``
        names (and what they read), or all of them."""
        wanted = set(TABLES) | set(VIEWS)
        if query is not None:
            words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", query.lower()))
            if wanted & words:  # else (SHOW TABLES, SELECT 1): every one, as before
                wanted = needed(wanted & words)
        registered = set()
        for name in TABLES:
            if name in wanted and (name in self._known or self.table_exists(name)):
                self.engine.execute(
                    f"CREATE OR REPLACE TEMPORARY VIEW {name} AS SELECT * FROM {self.ref(name)}"
                )
                registered.add(name)
        for view, text in VIEWS.items():  # not on an older warehouse being upgraded
            if view in wanted and registered >= needed({view}) - set(VIEWS):
                self.engine.execute(f"CREATE OR REPLACE TEMPORARY VIEW {view} AS {text(str)}")
