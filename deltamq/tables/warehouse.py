"""The warehouse: one directory (or URI) holding every deltamq table.

``Warehouse.init`` creates any missing table idempotently, seeds the delay levels,
and upgrades a warehouse of an older schema version in place (creates the tables
and adds the columns introduced since; see ``deltamq/schemas``). A warehouse of a
newer schema version than this release is refused rather than half-understood.
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING

from deltamq.config import TOMBSTONE_RETENTION, parse_levels, tombstone_retention
from deltamq.errors import ConfigError, SchemaVersionError
from deltamq.schemas import SCHEMA_VERSION, TABLES, TableSpec
from deltamq.tables.sqltext import sql_str

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from deltamq.engine import Engine

_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_FORBIDDEN_IN_PATH = ("`", "'", '"', "\n", "\r", "\x00", ";")


def normalize_location(location: str | os.PathLike[str]) -> str:
    """Absolute local path or a URI; refuses characters that could break SQL quoting."""
    text = os.fspath(location)
    if not text:
        raise ConfigError("the warehouse location is empty; give a directory or a URI")
    bad = [c for c in _FORBIDDEN_IN_PATH if c in text]
    if bad:
        raise ConfigError(
            f"warehouse location {text!r} contains {bad!r}; quotes, backticks, semicolons "
            "and control characters are not allowed"
        )
    if _URI.match(text):
        return text.rstrip("/")
    return os.path.abspath(text)


class Warehouse:
    """Locations and SQL references of every table of one warehouse."""

    def __init__(self, engine: Engine, location: str | os.PathLike[str]) -> None:
        self.engine = engine
        self.location = normalize_location(location)
        self._known: set[str] = set()

    @property
    def is_local(self) -> bool:
        return not _URI.match(self.location) or self.location.startswith("file://")

    @property
    def local_path(self) -> str:
        """Local filesystem path (for reading Delta commit entries directly)."""
        return self.location[len("file://") :] if self.location.startswith("file://") else self.location

    def path(self, table: str) -> str:
        TABLES[table]  # KeyError for an unknown table
        return f"{self.location}/{table}"

    def ref(self, table: str) -> str:
        """SQL reference of a table: delta.`<location>/<table>`."""
        return f"delta.`{self.path(table)}`"

    def read(self, table: str) -> DataFrame:
        return self.engine.spark.read.format("delta").load(self.path(table))

    def append(self, table: str, df: DataFrame) -> None:
        spec = TABLES[table]
        self.engine.append(df.select(*spec.schema.fieldNames()), self.path(table), spec.partition_by)

    # --- existence and creation ---------------------------------------------------------
    def table_exists(self, table: str) -> bool:
        if self.is_local:
            return os.path.isdir(os.path.join(self.local_path, table, "_delta_log"))
        try:
            self.read(table).schema  # noqa: B018 - resolving the schema is the probe
            return True
        except Exception:  # noqa: BLE001 - any failure to resolve means "not a Delta table"
            return False

    def table_columns(self, table: str) -> list[str]:
        return self.read(table).schema.fieldNames()

    def _create(self, spec: TableSpec, version: int) -> None:
        schema = spec.columns_at(version)
        empty = self.engine.spark.createDataFrame([], schema)
        # checkpoints keep remove tombstones only this long (jobs/compact.py)
        properties = {TOMBSTONE_RETENTION: tombstone_retention(self.engine.config)} | spec.properties

        def attempt() -> None:
            if self.table_exists(spec.name):
                return
            self.engine.append(empty, self.path(spec.name), spec.partition_by, properties)

        self.engine.commit(attempt, what=f"create {spec.name}")

    def _add_columns(self, spec: TableSpec, version: int) -> list[str]:
        have = set(self.table_columns(spec.name))
        wanted = spec.columns_at(version)
        missing = [f.name for f in wanted.fields if f.name not in have]
        if not missing:
            return []
        # Sail has no ALTER TABLE ADD COLUMNS: a schema-merging append of zero rows adds
        # nullable columns on every engine (docs/engines.md).
        empty = self.engine.spark.createDataFrame([], wanted)
        writer = empty.write.format("delta").mode("append").option("mergeSchema", "true")
        self.engine.commit(lambda: writer.save(self.path(spec.name)), what=f"upgrade {spec.name}")
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

    def init(self, levels: str | None = None, *, target_version: int = SCHEMA_VERSION) -> dict:
        """Create missing tables, upgrade older ones, seed levels. Idempotent.

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
        created: list[str] = []
        upgraded: dict[str, list[str]] = {}
        for spec in TABLES.values():
            if spec.added_in > target_version:
                continue
            if not self.table_exists(spec.name):
                self._create(spec, target_version)
                created.append(spec.name)
            elif current is None or current < target_version:
                added = self._add_columns(spec, target_version)
                if added:
                    upgraded[spec.name] = added
        self._seed_levels(levels)
        if current != target_version:
            self._set_meta("schema_version", str(target_version))
        self._known = set(TABLES)
        return {"created": created, "upgraded": upgraded, "from_version": current}

    def _set_meta(self, key: str, value: str) -> None:
        statement = (
            f"MERGE INTO {self.ref('warehouse_meta')} t "
            f"USING (SELECT {sql_str(key)} AS key, {sql_str(value)} AS value, "
            f"CAST({int(time.time() * 1000)} AS BIGINT) AS updated_ts) s ON t.key = s.key "
            "WHEN MATCHED THEN UPDATE SET t.value = s.value, t.updated_ts = s.updated_ts "
            "WHEN NOT MATCHED THEN INSERT (key, value, updated_ts) VALUES (s.key, s.value, s.updated_ts)"
        )
        self.engine.commit(lambda: self.engine.execute(statement), what="warehouse_meta")

    def _seed_levels(self, levels: str | None) -> None:
        existing = self.engine.rows(f"SELECT count(*) AS n FROM {self.ref('schedule_levels')}")[0]["n"]
        if existing and levels is None:
            return
        parsed = parse_levels(levels or self.engine.config.delay_levels)
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
        self.engine.commit(lambda: self.engine.execute(statement), what="schedule_levels")

    def levels(self) -> list[tuple[int, int]]:
        """(level, delay_ms) rows of ``schedule_levels``, by level."""
        rows = self.engine.rows(f"SELECT level, delay_ms FROM {self.ref('schedule_levels')} ORDER BY level")
        return [(r["level"], r["delay_ms"]) for r in rows]

    def ensure_ready(self) -> None:
        """Raise unless the warehouse was initialised at this release's schema version."""
        version = self.schema_version()
        if version is None:
            raise SchemaVersionError(
                f"{self.location} is not a deltamq warehouse yet; "
                f"run `deltamq init --warehouse {self.location}`"
            )
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"warehouse {self.location} has schema version {version}, this release needs "
                f"{SCHEMA_VERSION}; run `deltamq init` to upgrade"
                if version < SCHEMA_VERSION
                else f"warehouse {self.location} has schema version {version}, newer than this "
                f"release's {SCHEMA_VERSION}; upgrade deltamq"
            )

    def register_views(self) -> None:
        """Register every table as a temp view named after it, at its newest version."""
        for name in TABLES:
            if name in self._known or self.table_exists(name):
                self.engine.execute(
                    f"CREATE OR REPLACE TEMPORARY VIEW {name} AS SELECT * FROM {self.ref(name)}"
                )
