"""Reading a Delta table's files without the engine, from a snapshot kept between reads.

:class:`FileSnapshot` holds a table's live data files (their partition values and
column statistics) at a version. ``refresh()`` brings it up to date from the commit
entries written since, one look-up of the next entry when nothing changed (one GET on
an object store), so its cost follows new commits, not the table's history. Readers
pick files by partition values and min/max statistics (a range of offsets or batch
ids touches a handful of files) and read them whole with pyarrow, once: decoded files
are kept, and filters run over their narrow columns. A local file written in row groups
is read a row group at a time instead, only the groups a read needs (``taken``).

The first load goes through delta-rs (checkpoints included). Tables whose protocol
asks readers for more than plain Parquet files (deletion vectors, column mapping) are
refused with :class:`Unsupported`, and callers read them with the engine. The module
is Spark-free, like :mod:`deltamq.delta_append`, so clients without Spark can use it.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deltamq.delta_append import Unsupported

if TYPE_CHECKING:
    from deltamq.storage import Storage

READER_FEATURES = frozenset({"timestampNtz"})
"""Reader features a table may list and still be read here: they change no file's meaning."""
_COMMIT = re.compile(r"^\d{20}\.json$")
CACHE_BYTES = 256 << 20
"""Decoded files and their sorted keys a snapshot keeps (per table), least recently used
out first."""
GROUP_CACHE_BYTES = 48 << 20
"""Decoded row groups a snapshot keeps (per table; ``FileSnapshot.taken``), least recently
used out first. Small on purpose: a group is cheap to decode again, and memory freed
soon is reused by the next group's decode (measured: a pull client on groups of 8 MB
went from 47–60k msgs/s with them kept under the files' 256 MB to 62–66k, its slowest
cycles from ~30 ms to ~15 ms: fresh pages cost more than decoding)."""
RECHECK_S = 1.0
"""A refresh coming this long after the previous one lists the log once: Delta log
cleanup removes only entries older than the log retention (deltamq's is a whole number
of seconds, at least one), so a reader that refreshed within the last second cannot have
lost its next entry; one idle for longer may have, and then loads afresh."""


@dataclass(frozen=True)
class DataFile:
    """One live data file: absolute path, partition values as the log spells them, and
    the statistics the log recorded (missing ones are absent); ``log_path`` and ``size``
    as its ``add`` action gave them (what a commit removing it repeats)."""

    path: str
    partition: dict[str, str | None]
    min_values: dict[str, Any]
    max_values: dict[str, Any]
    num_records: int | None = None
    null_counts: dict[str, Any] = field(default_factory=dict)
    log_path: str = ""
    size: int | None = None

    def overlaps(self, column: str, lo: Any, hi: Any) -> bool:
        """Whether the file may hold a value of ``column`` in [lo, hi] (True without stats)."""
        low, high = self.min_values.get(column), self.max_values.get(column)
        return (high is None or high >= lo) and (low is None or low <= hi)

    def all_null(self, column: str) -> bool:
        """Whether the statistics say every row of the file has ``column`` null."""
        n = self.null_counts.get(column)
        return n is not None and self.num_records is not None and n >= self.num_records


@dataclass(frozen=True)
class SortedKeys:
    """A file's row keys in ascending order (``keys``) and the row each came from (``rows``)."""

    keys: np.ndarray
    rows: np.ndarray

    def rows_equal(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``wanted``: whether a row has that key (a mask) and that row."""
        at = np.searchsorted(self.keys, wanted)
        inside = at < len(self.keys)
        hit = np.zeros(len(wanted), dtype=bool)
        hit[inside] = self.keys[at[inside]] == wanted[inside]
        return hit, self.rows[np.where(hit, at, 0)] if len(self.rows) else np.zeros(len(wanted), np.int64)

    def rows_between(self, lo: int, hi: int) -> np.ndarray:
        """The rows whose key is in [lo, hi)."""
        return self.rows[np.searchsorted(self.keys, lo) : np.searchsorted(self.keys, hi)]


class BytePool(OrderedDict[Hashable, Any]):
    """Decoded data kept under a byte budget, least recently used first (a snapshot's
    caller holds its lock; a listener worker's reader, ``body_reads``, has one thread)."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self.held = 0
        self._sizes: dict[Hashable, int] = {}

    def use(self, key: Hashable) -> Any:
        """The entry under ``key``, now the most recently used; None when not kept."""
        data = self.get(key)
        if data is not None:
            self.move_to_end(key)
        return data

    def keep(self, key: Hashable, data: Any, size: int) -> Any:
        """``data`` kept under ``key`` (or what is kept there already); the least recently
        used entries out while the pool holds more than its budget (one entry always stays)."""
        kept = self.get(key)
        if kept is not None:
            return kept
        self[key] = data
        self._sizes[key] = size
        self.held += size
        while len(self) > 1 and self.held > self.budget:
            gone, _ = self.popitem(last=False)
            self.held -= self._sizes.pop(gone)
        return data

    def clear(self) -> None:
        super().clear()
        self._sizes.clear()
        self.held = 0


@dataclass(frozen=True)
class _Layout:
    """A Parquet file's footer and the first row of each of its row groups."""

    meta: Any
    starts: np.ndarray


class FileSnapshot:
    """The live files of the Delta table at ``uri`` (under ``storage``), kept up to date
    by :meth:`refresh`. Safe to share between threads."""

    def __init__(
        self,
        storage: Storage,
        uri: str,
        *,
        recheck_s: float = RECHECK_S,
        cache_bytes: int = CACHE_BYTES,
        group_cache_bytes: int = GROUP_CACHE_BYTES,
    ) -> None:
        self.storage = storage
        # decoded files (by path) and sorted keys ((path, name)); row groups ((path, index))
        # apart, with a budget of theirs
        self._cache = BytePool(cache_bytes)
        self._groups = BytePool(group_cache_bytes)
        self._layouts: dict[str, _Layout] = {}  # per file read by row groups
        self.uri = uri.rstrip("/")
        self.recheck_s = recheck_s
        self.version = -1
        self._files: dict[str, DataFile] = {}  # keyed by the log's (encoded, relative) path
        self._schema: pa.Schema | None = None
        self._partition_by: tuple[str, ...] = ()
        self._checked = 0.0
        self._lock = threading.RLock()
        self._unkeyed: set[tuple[str, str]] = set()  # (file, key name) that cannot be keyed

    # --- keeping up -----------------------------------------------------------------
    def refresh(self) -> int:
        """Read the commit entries written since the last refresh (the whole table the
        first time, or when the log no longer has the next entry); returns the version."""
        with self._lock:
            if self._schema is None:
                self._load()
                return self.version
            idle = time.monotonic() - self._checked
            while True:
                entry = self.storage.read_bytes(self._entry(self.version + 1))
                if entry is None:
                    break
                self._apply(self.version + 1, entry)
            if idle > self.recheck_s and self._latest_listed() > self.version:
                self._load()  # the next entry was removed by log cleanup
            self._checked = time.monotonic()
            return self.version

    def _latest_listed(self) -> int:
        names = (e.name for e in self.storage.list(self.uri + "/_delta_log"))
        return max((int(n[:20]) for n in names if _COMMIT.match(n)), default=-1)

    def _entry(self, version: int) -> str:
        return f"{self.uri}/_delta_log/{version:020d}.json"

    def _load(self) -> None:
        table = self.storage.delta_table(self.uri)
        _check_protocol(self.uri, table.protocol())
        schema = table.schema().to_arrow()
        self._schema = pa.schema(schema) if not isinstance(schema, pa.Schema) else schema
        self._partition_by = tuple(table.metadata().partition_columns)
        files: dict[str, DataFile] = {}
        for row in pa.table(table.get_add_actions(flatten=True)).to_pylist():
            stats: dict[str, dict[str, Any]] = {"min": {}, "max": {}, "null_count": {}, "partition": {}}
            for key, value in row.items():
                kind, _, column = key.partition(".")
                if kind in stats and column:
                    stats[kind][column] = value
            files[row["path"]] = DataFile(
                self.storage.absolute(self.uri, row["path"]),
                {k: _log_value(v) for k, v in stats["partition"].items()},
                stats["min"],
                stats["max"],
                row.get("num_records"),
                stats["null_count"],
                row["path"],
                row.get("size_bytes"),
            )
        self._files = files
        self._forget_all()  # decoded with the old schema
        self.version = table.version()
        self._checked = time.monotonic()

    def _apply(self, version: int, entry: bytes) -> None:
        for line in entry.splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            if "metaData" in action or "protocol" in action:
                self._load()  # a schema, partitioning or protocol change: read it all again
                return
            if "remove" in action:
                gone = self._files.pop(action["remove"]["path"], None)
                if gone is not None:
                    self._layouts.pop(gone.path, None)
            elif "add" in action:
                add = action["add"]
                if add.get("deletionVector"):
                    raise Unsupported(f"{self.uri} version {version} has deletion vectors")
                stats = json.loads(add["stats"]) if add.get("stats") else {}
                self._files[add["path"]] = DataFile(
                    self.storage.absolute(self.uri, add["path"]),
                    add.get("partitionValues") or {},
                    stats.get("minValues") or {},
                    stats.get("maxValues") or {},
                    stats.get("numRecords"),
                    stats.get("nullCount") or {},
                    add["path"],
                    add.get("size"),
                )
        self.version = version

    # --- reading --------------------------------------------------------------------
    @property
    def column_names(self) -> list[str]:
        """The table's columns (partition columns included), as of the last refresh."""
        with self._lock:
            assert self._schema is not None, "refresh() first"
            return list(self._schema.names)

    def files(self, keep: Callable[[DataFile], bool] = lambda f: True) -> list[DataFile]:
        """The live files ``keep`` accepts (as of the last refresh)."""
        with self._lock:
            return [f for f in self._files.values() if keep(f)]

    def read(
        self, files: Iterable[DataFile], columns: list[str], where: pc.Expression | None = None
    ) -> pa.Table:
        """Rows of ``files`` matching ``where``, ``columns`` only; partition columns are
        filled from each file's values."""
        chosen = list(files)
        if not chosen:
            with self._lock:
                assert self._schema is not None, "refresh() first"
                return self._schema.empty_table().select(columns)
        tables = [self.whole(f) for f in chosen]
        if where is not None:
            tables = [_filter(t, where) for t in tables]
        return pa.concat_tables([t.select(columns) for t in tables])

    def columns(self, f: DataFile, names: list[str]) -> pa.Table:
        """The ``names`` columns of file ``f`` (partition columns filled in): from the
        decoded file when it is kept, else read alone and not kept (a reader that needs a
        few narrow columns of many rows need not decode, nor evict, the wide ones)."""
        with self._lock:
            data = self._cache.get(f.path)
            schema, parts = self._schema, self._partition_by
        if data is not None:
            return cast(pa.Table, data).select(names)
        assert schema is not None, "refresh() first"
        return self._decode(f, schema, parts, names).select(names)

    def sorted_keys(
        self,
        f: DataFile,
        name: str,
        key: Callable[[pa.Table], np.ndarray | None],
        needs: list[str],
        narrow: bool = False,
    ) -> SortedKeys | None:
        """File ``f``'s rows ordered by ``key`` (an int64 per row, computed from the file's
        ``needs`` columns; None: the file cannot be keyed so), kept under ``name`` in the
        snapshot's cache: a reader of a few rows of a large file finds them by binary
        search instead of a filter over every row. The key columns are read alone from a
        file read by row groups (:meth:`taken`), else from the whole file, decoded once
        and kept (on S3 one GET serves both), or with ``narrow`` read alone in any case
        (a reader that wants no other column of the file)."""
        cache_key = (f.path, name)
        with self._lock:
            found = self._cache.use(cache_key)
            if found is not None:
                return cast(SortedKeys, found)
            if cache_key in self._unkeyed:
                return None
        keys = key(self.columns(f, needs) if narrow or self._grouped(f) is not None else self.whole(f))
        if keys is None:
            with self._lock:
                self._unkeyed.add(cache_key)
            return None
        order = np.argsort(keys, kind="stable")
        found = SortedKeys(keys[order], order)
        with self._lock:
            return cast(SortedKeys, self._cache.keep(cache_key, found, found.keys.nbytes + found.rows.nbytes))

    def seed(self, written: Iterable[tuple[str, pa.Table, dict[str, str | None]]]) -> None:
        """Files this process has just appended (``delta_append.Written``: the log's path,
        the rows as stored, the partition values), kept decoded as :meth:`whole` would
        decode them, so the next reader of them (deliver, after dispatch wrote the index)
        decodes nothing. Within the cache's budget only; rows of another schema are not kept."""
        with self._lock:
            schema, parts = self._schema, self._partition_by
        if schema is None:
            return
        stored = [f for f in schema if f.name not in parts]
        for path, data, values in written:
            if data.nbytes > self._cache.budget or [f.name for f in stored] != data.column_names:
                continue
            try:
                table = pa.table([data.column(f.name).cast(f.type) for f in stored], schema=pa.schema(stored))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            for name in parts:
                field = schema.field(name)
                value = pa.scalar(_typed(values.get(name), field.type), field.type)
                table = table.append_column(field, pa.repeat(value, table.num_rows))
            with self._lock:
                self._cache.keep(self.storage.absolute(self.uri, path), table, table.nbytes)

    def whole(self, f: DataFile) -> pa.Table:
        """Every row of file ``f``, partition columns filled in; kept (data files never
        change) in a cache of at most ``cache_bytes``, least recently used out first: the
        next read of a range usually lands in the file the last one read."""
        with self._lock:
            data = self._cache.use(f.path)
            if data is not None:
                return cast(pa.Table, data)
            schema, parts = self._schema, self._partition_by
        assert schema is not None, "refresh() first"
        data = self._decode(f, schema, parts, schema.names)
        with self._lock:
            return cast(pa.Table, self._cache.keep(f.path, data, data.nbytes))

    def taken(self, f: DataFile, rows: np.ndarray, names: list[str]) -> pa.Table:
        """The ``names`` columns of file ``f`` at its rows ``rows`` (in that order). A file
        of several row groups on a local disk is decoded a row group at a time, only those
        holding ``rows`` (kept apart from the files, under ``group_cache_bytes``): a
        client of a few queues decodes the groups of its queues when the writer grouped
        the rows by queue (deltamq/delta_append.py). Otherwise the whole file is decoded
        and kept."""
        if len(rows) == 0:
            return self.read([], names)
        layout = self._grouped(f)
        if layout is None:
            return picked(self.whole(f).select(names), rows)
        groups = np.searchsorted(layout.starts, rows, side="right") - 1
        wanted = np.unique(groups)
        tables = [self._group(f, layout, int(g)).select(names) for g in wanted]
        sizes = np.array([t.num_rows for t in tables], dtype=np.int64)
        first = np.zeros(len(layout.starts), dtype=np.int64)  # where each wanted group begins
        first[wanted] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        at = first[groups] + (rows - layout.starts[groups])
        return picked(pa.concat_tables(tables), at)

    def largest_group(self, f: DataFile) -> int | None:
        """Rows in the largest row group of local file ``f`` (its footer, read once); None
        off a local disk."""
        layout = self._layout(f)
        if layout is None:
            return None
        ends = np.append(
            layout.starts[1:], f.num_records if f.num_records is not None else layout.meta.num_rows
        )
        return int(np.max(ends - layout.starts)) if len(ends) else 0

    def _grouped(self, f: DataFile) -> _Layout | None:
        """The row groups :meth:`taken` reads file ``f`` by: those of a local file of
        several row groups not decoded whole already, else None."""
        layout = self._layout(f)
        if layout is None or len(layout.starts) < 2 or f.path in self._cache:
            return None
        return layout

    def _layout(self, f: DataFile) -> _Layout | None:
        """The row groups of a local file (its Parquet footer, read once), or None."""
        if not self.storage.is_local:
            return None  # one GET of the whole file beats ranged GETs of its groups on S3
        with self._lock:
            layout = self._layouts.get(f.path)
        if layout is None:
            meta = self.storage.parquet_metadata(f.path)
            layout = _Layout(meta, group_starts(meta))
            with self._lock:
                self._layouts[f.path] = layout
        return layout

    def _group(self, f: DataFile, layout: _Layout, index: int) -> pa.Table:
        """Row group ``index`` of file ``f``, every column, partition columns filled in; kept."""
        cache_key = (f.path, index)
        with self._lock:
            data = self._groups.use(cache_key)
            if data is not None:
                return cast(pa.Table, data)
            schema, parts = self._schema, self._partition_by
        assert schema is not None, "refresh() first"
        data = self._decode(f, schema, parts, schema.names, (layout.meta, index))
        with self._lock:
            return cast(pa.Table, self._groups.keep(cache_key, data, data.nbytes))

    def _forget_all(self) -> None:
        with self._lock:
            self._cache.clear()
            self._groups.clear()
            self._layouts.clear()
            self._unkeyed.clear()

    def _decode(
        self,
        f: DataFile,
        schema: pa.Schema,
        parts: tuple[str, ...],
        names: list[str],
        group: tuple[Any, int] | None = None,
    ) -> pa.Table:
        """The ``names`` columns of file ``f`` read from its Parquet (of one row group:
        ``group`` = (the file's metadata, its index)), then the partition columns among
        them filled from its values."""
        stored = [n for n in names if n not in parts]
        data = self.storage.read_parquet(f.path, pa.schema([schema.field(n) for n in stored]), group)
        for name in (n for n in parts if n in names):
            field = schema.field(name)
            value = _typed(f.partition.get(name), field.type)
            data = data.append_column(field, pa.array([value] * data.num_rows, field.type))
        return data


def group_starts(meta: Any) -> np.ndarray:
    """The first row of each row group of a Parquet file (its footer, ``meta``)."""
    counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _filter(table: pa.Table, where: pc.Expression) -> pa.Table:
    """``table``'s rows matching ``where``: the filter runs over its narrow columns only
    (a predicate never reads a body), and the wide ones are taken at the matching rows,
    so bodies are copied once."""
    wide = [f.name for f in table.schema if _wide(f.type)]
    if not wide:
        return table.filter(where)
    rows = positions(table.num_rows)
    narrow = table.drop_columns(wide).append_column("_row", rows)
    return table.take(narrow.filter(where).column("_row"))


_POSITIONS: list[pa.Array] = [pa.array([], pa.int64())]


RUN_ROWS = 1024
"""Rows per run, on average, from which :func:`picked` slices instead of copying."""


def picked(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table``'s rows at ``rows`` (in that order). Rows that come as a few ascending runs
    (a queue's rows in a file ordered by queue: a handful of runs for thousands of rows)
    and make a large share of ``table`` (a slice keeps the whole table's buffers alive)
    are slices of it, shared rather than copied; others are taken."""
    n = len(rows)
    if n == 0:
        return table.slice(0, 0)
    if rows.min() < 0 or rows.max() >= table.num_rows:
        raise IndexError(f"rows {rows.min()}..{rows.max()} of a table of {table.num_rows}")
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    if (len(cuts) + 1) * RUN_ROWS > n or n * 4 < table.num_rows:
        return table.take(pa.array(rows, pa.int64()))
    starts = np.concatenate([[0], cuts])
    ends = np.append(cuts, n)
    return pa.concat_tables(
        [table.slice(int(rows[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]
    )


def positions(n: int) -> pa.Array:
    """0 … n−1, sliced from one array kept and grown as needed."""
    if len(_POSITIONS[0]) < n:
        _POSITIONS[0] = pa.array(range(max(n, 2 * len(_POSITIONS[0]))), pa.int64())
    return _POSITIONS[0].slice(0, n)


def _wide(kind: pa.DataType) -> bool:
    return (
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_map(kind)
        or pa.types.is_list(kind)
        or pa.types.is_struct(kind)
    )


def _check_protocol(uri: str, protocol: Any) -> None:
    features = set(protocol.reader_features or ())
    if protocol.min_reader_version == 1 or (protocol.min_reader_version == 3 and features <= READER_FEATURES):
        return
    raise Unsupported(
        f"{uri} has reader protocol {protocol.min_reader_version} with features {sorted(features)}; "
        f"reading its files here supports version 1 and {sorted(READER_FEATURES)}"
    )


def _log_value(v: Any) -> str | None:
    """A partition value as the Delta log spells it."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (_dt.date, _dt.datetime)):
        return v.isoformat()
    return str(v)


def _typed(text: str | None, kind: pa.DataType) -> Any:
    if text is None:
        return None
    if pa.types.is_integer(kind):
        return int(text)
    if pa.types.is_date(kind):
        return _dt.date.fromisoformat(text)
    if pa.types.is_boolean(kind):
        return text == "true"
    if pa.types.is_floating(kind):
        return float(text)
    return text
