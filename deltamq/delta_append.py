"""Blind appends to a Delta table without an engine: one Parquet file per partition value
and one commit entry, written put-if-absent.

The Spark-free producer appends a batch of messages to ``commit_log`` many times a
second. delta-rs' writer costs O(files in the table) per commit (it carries the whole
snapshot forward: 10 ms per append at 20 files, 40 ms at 300, measured), so an append
here is what the Delta protocol asks of a blind append and no more:

1. each partition's rows are written as a new Parquet file under a fresh name (the
   partition columns are in the path, not in the file);
2. a commit entry ``<version>.json`` holding a ``commitInfo`` (with this append's own
   ``txnId``) and one ``add`` per file, with statistics (``numRecords``, min and max,
   null counts) that dispatch and file skipping read, is created put-if-absent at the
   version after the last one known;
3. when the version is taken, the winner's entry is read: if it is this append's own
   (its write landed, its answer was lost), the append is done; if it changed the
   table's metadata or protocol, the table is read again and the check repeated; any
   other commit (another producer, the broker's jobs, retention) cannot conflict with a
   blind append, and the next version is tried.

Every ``checkpoint_interval``-th version gets a checkpoint from delta-rs, as its writer
would have written. Only tables whose protocol this writer meets are appended here
(writer version 2, or table features among ``appendOnly`` and ``invariants``, with no
invariants, generated or identity columns in the schema); :class:`Unsupported` says why
not, and the caller writes with delta-rs instead.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deltamq.errors import DeltaMQError, StorageError, VersionTaken

if TYPE_CHECKING:
    from deltamq.storage import Storage

log = logging.getLogger("deltamq.append")

WRITER_FEATURES = frozenset({"appendOnly", "invariants"})
MAX_VERSION_STEPS = 10_000
"""Versions one append may walk past (other writers' commits) before it gives up."""
REREAD_EVERY = 16
"""Taken versions in a row after which the table is read again (its head, in one read)."""
STATS_STRING_CHARS = 32
"""Strings longer than this get no min/max statistics (Delta truncates them; omitted here)."""
_STATS_TYPES = (pa.types.is_integer, pa.types.is_date, pa.types.is_string, pa.types.is_boolean)


def plain_writer(protocol: Any) -> bool:
    """Whether a table's protocol (delta-rs' ``ProtocolVersions``) asks a writer for no
    more than plain Parquet files and commit entries: writer version 2, or table features
    among :data:`WRITER_FEATURES` (no deletion vectors, column mapping, ...)."""
    features = set(protocol.writer_features or ())
    return bool(
        protocol.min_writer_version <= 2 or (protocol.min_writer_version == 7 and features <= WRITER_FEATURES)
    )


class Unsupported(DeltaMQError, RuntimeError):
    """The table needs a writer this module is not (its protocol, features or schema)."""


class LiveFile(Protocol):
    """A data file as a reader's snapshot knows it (``delta_read.DataFile``): what a
    commit removing it repeats from its ``add``."""

    @property
    def log_path(self) -> str: ...
    @property
    def partition(self) -> dict[str, str | None]: ...
    @property
    def size(self) -> int | None: ...


@dataclass(frozen=True)
class _State:
    version: int
    schema: pa.Schema  # the columns stored in the files
    partition_by: tuple[str, ...]
    checkpoint_interval: int
    append_only: bool = False  # delta.appendOnly: files are never removed


ORDERED_BY_TAG = "deltamq.orderedBy"
"""The ``add`` action's tag (Delta's per-file metadata) naming the ``group_by`` columns a
file's rows are ordered by, when they are: a reader may plan on that order (dispatch
indexes such files without re-ordering them, deltamq/tables/index_files.py)."""
GROUPED_FROM = 4096
"""A file of at least this many rows is written in row groups by the appender's
``group_by`` columns (smaller files are decoded whole cheaply)."""
GROUP_ROWS = 8192
"""At most this many rows in a row group written by ``group_by`` (8 MB of 1 KiB bodies)."""
GROUP_MIN_ROWS = 1024
"""A row group written by ``group_by`` takes the next value's rows too while it holds
fewer than this many (a send over thousands of queues writes groups of several queues,
not thousands of tiny groups)."""
SPLIT_FROM = 64 << 20
"""A partition's rows of at least this many bytes in memory are written as several
files at once, one per writer (:data:`WRITERS`), cut between row groups: the send of
1M x 1 KiB wrote its one file in 0.50-0.58 s, two files in two threads in 0.26-0.36 s;
dispatch's index of those 1M rows (about 100 MB) is split too (bench/README.md)."""
WRITERS = max(1, min(4, os.cpu_count() or 1))
"""Files a large partition is written as, at once: one per core, at most four."""
STREAM_FROM = 16 << 20
"""Rows of at least this many bytes in memory are written through a temporary file (a
1 GB Parquet file built in a buffer cost its copy and a 2.5 s write); smaller ones from
a buffer, one write (0.15-0.2 ms less per small file than pyarrow's writes to a path)."""


Written = tuple[str, pa.Table, dict[str, "str | None"]]
"""A file an append wrote: its path as the log names it, its rows as stored (no partition
columns) and its partition values."""


class BlindAppender:
    """Appends Arrow tables to the Delta table at ``uri`` (under ``storage``); keeps what
    it knows of the table (version, schema, partitioning) between appends.

    ``on_written``: told each append's files once it is committed (their log paths,
    rows as stored and partition values), so a reader in this process may keep them
    decoded (``delta_read.FileSnapshot.seed``).

    ``group_by``: a file of :data:`GROUPED_FROM` rows or more holds its rows ordered by
    these columns, in row groups of one value each (at most :data:`GROUP_ROWS` rows;
    values with fewer than :data:`GROUP_MIN_ROWS` rows share a group), so a reader of
    one value decodes its groups only (``FileSnapshot.taken``): the producers'
    ``commit_log`` files by topic and queue, for pull clients of a few queues. Such a
    file's ``add`` carries :data:`ORDERED_BY_TAG`. Readers never depend on the rows'
    order for their results; dispatch takes the tag as a hint of its cost only."""

    def __init__(
        self,
        storage: Storage,
        uri: str,
        *,
        engine_info: str = "deltamq",
        group_by: tuple[str, ...] = (),
        on_written: Callable[[list[Written]], None] | None = None,
    ) -> None:
        self.storage = storage
        self.on_written = on_written
        self._written: list[Written] = []
        self._collect = False
        self.uri = uri.rstrip("/")
        self.engine_info = engine_info
        self.group_by = group_by
        self._state: _State | None = None

    # --- the table ------------------------------------------------------------------
    def _load(self) -> _State:
        table = self.storage.delta_table(self.uri)
        protocol, meta = table.protocol(), table.metadata()
        features = set(protocol.writer_features or ())
        if not plain_writer(protocol):
            raise Unsupported(
                f"{self.uri} has writer protocol {protocol.min_writer_version} with features "
                f"{sorted(features)}; appends here support version 2 and {sorted(WRITER_FEATURES)}"
            )
        schema = table.schema().to_arrow()
        schema = pa.schema(schema) if not isinstance(schema, pa.Schema) else schema
        for field in schema:
            meta_keys = {k.decode() if isinstance(k, bytes) else k for k in (field.metadata or {})}
            special = {"delta.invariants", "delta.generationExpression", "delta.identity.start"} & meta_keys
            if special:
                raise Unsupported(f"{self.uri}: column {field.name} has {sorted(special)}")
        parts = tuple(meta.partition_columns)
        stored = pa.schema([f.remove_metadata() for f in schema if f.name not in parts])
        interval = int(meta.configuration.get("delta.checkpointInterval") or 100)
        append_only = str(meta.configuration.get("delta.appendOnly") or "").lower() == "true"
        return _State(table.version(), stored, parts, max(1, interval), append_only)

    def _current(self) -> _State:
        if self._state is None:
            self._state = self._load()
        return self._state

    # --- appending ------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The table's version as this appender last knew it (its last commit or read)."""
        return None if self._state is None else self._state.version

    def ready(self) -> None:
        """Read the table once (Unsupported when this writer cannot append to it)."""
        self._current()

    def append(self, rows: pa.Table, *, at: int | None = None) -> int:
        """Append ``rows`` (the table's columns, partition columns included) in one
        commit; returns its version. With ``at``, the commit is that version or nothing:
        when another writer has it, :class:`VersionTaken` (a commit conflict: the caller
        planned ``rows`` from the table as of ``at - 1`` and plans again). Such a commit
        is not a blind append (its ``readVersion`` is ``at - 1``), and the table's
        metadata is read again first when a commit since the last one known changed it.
        Once committed, the files go to ``on_written``, when given."""
        self._written = []
        self._collect = self.on_written is not None
        try:
            version = self._append(rows, at)
            if self.on_written is not None:
                self.on_written(self._written)
        finally:
            self._written, self._collect = [], False
        return version

    def _append(self, rows: pa.Table, at: int | None) -> int:
        state = self._current() if at is None else self._known_at(at - 1)
        txn = str(uuid.uuid4())
        adds = self._write_files(state, rows)
        entry = self._entry(txn, adds, state, None if at is None else at - 1)
        if at is not None:
            return self._append_at(at, txn, entry, state, adds)
        version = state.version + 1
        for step in range(MAX_VERSION_STEPS):
            path = self._log_entry(version)
            if self.storage.put_if_absent(path, entry):
                if version == 0 or self.storage.exists(self._log_entry(version - 1)):
                    break
                # the entry before is gone: log cleanup removed the versions this appender
                # last knew, below a newer checkpoint, which every reader starts from, so
                # this entry would never be read. Withdraw it; commit at the real head.
                self.storage.delete(path)
                version = self._reload(state, version) + 1
                continue
            winner = self.storage.read_bytes(path)
            if winner is None:
                # refused, yet nothing is there (a create that conflicted with another
                # request in flight): the same version again
                time.sleep(0.01 * (1 + step % 5))
                continue
            if _txn_of(winner) == txn:
                break  # this append's own entry: the write landed, its answer was lost
            if _changes_table(winner) or step % REREAD_EVERY == REREAD_EVERY - 1:
                # a metadata or protocol change, or far behind the head: read the table again
                version = max(version, self._reload(state, version))
            version += 1
        else:
            raise StorageError(
                f"cannot append to {self.uri}: {MAX_VERSION_STEPS} versions were taken by other "
                "writers while this append waited"
            )
        return self._committed(version, state)

    def replace(
        self,
        removed: Sequence[LiveFile],
        rows: pa.Table,
        *,
        at: int,
        operation: tuple[str, dict[str, str]] = ("UPDATE", {}),
    ) -> int:
        """One commit at version ``at`` or none (:class:`VersionTaken` when another writer
        has it): the files ``removed`` (live at ``at - 1``) out, ``rows`` in as new files
        (none when it is empty). The caller computed ``rows`` from what the table held at
        ``at - 1`` (the rows of ``removed``, changed, and any new ones), so the commit is
        a compare-and-set of those files: a writer that came between refuses it, and the
        caller reads again and plans again. Small tables written often (the pull clients'
        lock rows) change so without a ``MERGE``; ``operation`` names the change in the
        commit's ``commitInfo``."""
        state = self._known_at(at - 1)
        if state.append_only and removed:
            raise Unsupported(f"{self.uri} is append-only (delta.appendOnly): its files cannot be replaced")
        txn = str(uuid.uuid4())
        adds = self._write_files(state, rows) if rows.num_rows else []
        now = int(time.time() * 1000)
        removes = [
            {
                "path": f.log_path,
                "deletionTimestamp": now,
                "dataChange": True,
                "extendedFileMetadata": f.size is not None,
                "partitionValues": f.partition,
                **({"size": f.size} if f.size is not None else {}),
            }
            for f in removed
        ]
        if not removes and not adds:
            return state.version
        entry = self._entry(txn, adds, state, at - 1, removes, operation)
        return self._append_at(at, txn, entry, state, adds)

    def _known_at(self, version: int) -> _State:
        """What the appender knows of the table, brought to ``version`` (a caller's
        snapshot): the commits in between are read once for a metadata or protocol change
        (then the table is read again), and not again by the next call."""
        state = self._current()
        if state.version < version:
            if self._changed_between(state.version, version + 1):
                self._state = None  # the table's metadata or protocol changed since: read it again
                return self._current()
            state = self._state = dataclasses.replace(state, version=version)
        return state

    def _committed(self, version: int, state: _State) -> int:
        """After this append's commit at ``version``: what the appender knows of the table
        moves there, and every ``checkpoint_interval``-th version gets its checkpoint."""
        self._state = dataclasses.replace(state, version=max(version, state.version))
        if version % state.checkpoint_interval == 0:
            self._checkpoint(version)
        return version

    def _changed_between(self, known: int, at: int) -> bool:
        """Whether a commit after ``known`` and before ``at`` changed the table's metadata or
        protocol (or is gone from the log, which says nothing: assume it did)."""
        for v in range(known + 1, at):
            entry = self.storage.read_bytes(self._log_entry(v))
            if entry is None or _changes_table(entry):
                return True
        return False

    def _append_at(
        self, version: int, txn: str, entry: bytes, state: _State, adds: list[dict[str, Any]]
    ) -> int:
        """``entry`` committed at exactly ``version``, or :class:`VersionTaken`. Only when
        another writer's entry is read there are this commit's data files ``adds``
        deleted again (best effort: no commit points at them); when it is not known
        whether its own entry landed (a create refused with nothing readable, or an
        entry withdrawn that a checkpoint may already hold), they stay for vacuum."""
        path = self._log_entry(version)
        for _ in range(5):
            if self.storage.put_if_absent(path, entry):
                if version and not self.storage.exists(self._log_entry(version - 1)):
                    # the entry before is gone: log cleanup removed it below a newer
                    # checkpoint, which every reader starts from, so this one would
                    # never be read. Withdrawn; the caller reads the table again
                    self.storage.delete(path)
                    raise VersionTaken(f"{self.uri}: version {version - 1} was cleaned up")
                break
            winner = self.storage.read_bytes(path)
            if winner is None:
                time.sleep(0.01)  # refused, yet nothing there: a create racing another request
                continue
            if _txn_of(winner) == txn:
                break  # this append's own entry: the write landed, its answer was lost
            self._discard(adds)
            raise VersionTaken(f"{self.uri}: version {version} was committed by another writer")
        else:
            raise VersionTaken(f"{self.uri}: version {version} could not be created")
        return self._committed(version, state)

    def _discard(self, adds: list[dict[str, Any]]) -> None:
        """The data files of a commit another writer's entry took the place of."""
        for add in adds:
            try:
                self.storage.delete(f"{self.uri}/{unquote(add['path'])}")
            except Exception:  # noqa: BLE001 - an orphan file is vacuum's to remove
                log.debug("could not delete %s after a refused commit", add["path"])

    def _log_entry(self, version: int) -> str:
        return f"{self.uri}/_delta_log/{version:020d}.json"

    def _reload(self, state: _State, version: int) -> int:
        """The table read again (its latest version); Unsupported when its schema or
        partitioning is no longer the one ``state`` wrote the files for."""
        self._state = None
        fresh = self._current()
        if fresh.schema != state.schema or fresh.partition_by != state.partition_by:
            raise Unsupported(f"{self.uri} changed its schema or partitioning at version {version}")
        return fresh.version

    def _write_files(self, state: _State, rows: pa.Table) -> list[dict[str, Any]]:
        """``rows`` written as new files, one per partition value (or, for a large one,
        one per writer: :data:`SPLIT_FROM`); their ``add`` actions."""
        return [
            add
            for values, mask in _partitions(rows, state.partition_by)
            for add in self._write_part(state, rows.filter(mask) if mask is not None else rows, values)
        ]

    def _write_part(
        self, state: _State, part: pa.Table, values: dict[str, str | None]
    ) -> list[dict[str, Any]]:
        data = part.select(state.schema.names).cast(state.schema)
        grouped = [c for c in self.group_by if c in state.schema.names]
        runs: list[tuple[int, int]] | None = None
        if grouped and data.num_rows >= GROUPED_FROM:
            order = pc.sort_indices(data, [(c, "ascending") for c in grouped])
            if not _in_order(order):  # rows a producer built in order are not copied again
                data = data.take(order)
            runs = _runs(data, grouped, GROUP_MIN_ROWS, GROUP_ROWS)
        # where a large file may be cut: between its row groups, or anywhere (even shares)
        cuts = runs or [
            (i * data.num_rows // WRITERS, (i + 1) * data.num_rows // WRITERS) for i in range(WRITERS)
        ]
        pieces = _pieces(data.num_rows, data.nbytes, [c for c in cuts if c[1] > c[0]], WRITERS)
        if len(pieces) == 1:
            return [self._write_file(data, runs, grouped, values)]
        # pyarrow's encoder releases the GIL: the pieces are encoded on every core at once
        with ThreadPoolExecutor(len(pieces), thread_name_prefix="deltamq-append") as pool:
            return list(
                pool.map(
                    lambda p: self._write_file(
                        data.slice(p[0][0], p[-1][1] - p[0][0]),
                        [(lo - p[0][0], hi - p[0][0]) for lo, hi in p] if runs is not None else None,
                        grouped,
                        values,
                    ),
                    pieces,
                )
            )

    def _write_file(
        self,
        data: pa.Table,
        runs: list[tuple[int, int]] | None,
        grouped: list[str],
        values: dict[str, str | None],
    ) -> dict[str, Any]:
        # wide binary columns (bodies) get neither a dictionary nor page statistics: each
        # value is its own, and min/max of a body help no reader (1 KiB each, per page)
        wide = [f.name for f in data.schema if _wide_binary(f.type)]
        narrow = [n for n in data.schema.names if n not in wide]
        options: dict[str, Any] = {"compression": "snappy"}
        if wide:
            options |= {"use_dictionary": narrow, "write_statistics": narrow}

        def write(sink: Any) -> None:
            if runs is None:
                pq.write_table(data, sink, **options)
                return
            with pq.ParquetWriter(sink, data.schema, **options) as writer:
                for lo, hi in runs:
                    writer.write_table(data.slice(lo, hi - lo), row_group_size=hi - lo)

        # the folder as Hive names it (special characters as %XX), and the log's path a
        # URI of it (percent-encoded once more), as Delta-Spark writes them
        folder = "/".join(f"{_hive(k)}={_hive(_path_value(v))}" for k, v in values.items())
        name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
        rel = f"{folder}/{name}" if folder else name
        if data.nbytes < STREAM_FROM:  # a small file: one write from memory is cheaper
            buf = io.BytesIO()
            write(buf)
            size = self.storage.put(f"{self.uri}/{rel}", buf.getvalue())
        else:
            size = self.storage.put(f"{self.uri}/{rel}", write)
        path = quote(rel, safe="/=:@!$&'()*+,;")  # a URI path: RFC 3986's pchar kept
        if self._collect:  # an append's files, not a replace's
            self._written.append((path, data, values))
        return {
            "path": path,
            "partitionValues": values,
            "size": size,
            "modificationTime": int(time.time() * 1000),
            "dataChange": True,
            "stats": json.dumps(_stats(data), separators=(",", ":")),
            **({"tags": {ORDERED_BY_TAG: ",".join(grouped)}} if runs is not None else {}),
        }

    def _entry(
        self,
        txn: str,
        adds: list[dict[str, Any]],
        state: _State,
        read_version: int | None = None,
        removes: list[dict[str, Any]] | None = None,
        operation: tuple[str, dict[str, str]] | None = None,
    ) -> bytes:
        name, parameters = operation or (
            "WRITE",
            {"mode": "Append", "partitionBy": json.dumps(list(state.partition_by))},
        )
        info: dict[str, Any] = {
            "timestamp": int(time.time() * 1000),
            "operation": name,
            "operationParameters": parameters,
            "isBlindAppend": read_version is None,
            "engineInfo": self.engine_info,
            "txnId": txn,
        }
        if read_version is not None:
            # rows planned from what the table held at read_version: not a blind append, so
            # a writer that read the table before this commit (a MERGE of the same rows)
            # finds its files among what it should have read, and conflicts (Delta's
            # checkers pass over a winner's files only when it says it was blind)
            info["readVersion"] = read_version
        lines = [json.dumps({"commitInfo": info}, separators=(",", ":"))]
        lines += [json.dumps({"remove": r}, separators=(",", ":")) for r in removes or ()]
        lines += [json.dumps({"add": a}, separators=(",", ":")) for a in adds]
        return ("\n".join(lines) + "\n").encode("utf-8")

    def _checkpoint(self, version: int) -> None:
        """A checkpoint at ``version`` (readers replay the log from the last one). A failed
        checkpoint leaves the table whole, only slower to open: said in the log."""
        try:
            self.storage.delta_table(self.uri, version=version).create_checkpoint()
        except Exception as e:  # noqa: BLE001 - the append itself is committed
            log.warning("appended %s at version %d, but its checkpoint failed: %s", self.uri, version, e)


def _partitions(rows: pa.Table, columns: tuple[str, ...]) -> list[tuple[dict[str, str | None], Any]]:
    """(partition values as the log writes them, a row mask or None for all rows)."""
    if not columns:
        return [({}, None)]
    if len(columns) == 1:  # the usual case (commit_log's day): no Python object per row
        distinct = [(v,) for v in pc.unique(rows[columns[0]]).to_pylist()]
    else:  # the distinct combinations by Arrow (the index's topic and slot), not row by row
        found = rows.select(list(columns)).group_by(list(columns), use_threads=False).aggregate([])
        distinct = list(zip(*(found.column(c).to_pylist() for c in columns), strict=True))
    if len(distinct) == 1:
        return [({c: _log_value(v) for c, v in zip(columns, distinct[0], strict=True)}, None)]
    out = []
    for values in distinct:
        mask = None
        for c, v in zip(columns, values, strict=True):
            col = rows[c]
            m = pc.is_null(col) if v is None else pc.equal(col, pa.scalar(v, col.type))
            mask = m if mask is None else pc.and_(mask, m)
        out.append(({c: _log_value(v) for c, v in zip(columns, values, strict=True)}, mask))
    return out


def _log_value(v: Any) -> str | None:
    """A partition value as the Delta log spells it (ISO dates, plain numbers)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def _hive(text: str) -> str:
    """A partition column or value as a folder name: Hive's escaping of the characters a
    path cannot hold as they are."""
    return "".join(f"%{ord(c):02X}" if c in _HIVE_ESCAPED or ord(c) < 0x20 else c for c in text)


_HIVE_ESCAPED = frozenset("\"#%'*/:=?\\{[]^\x7f")


def _path_value(v: str | None) -> str:
    return "__HIVE_DEFAULT_PARTITION__" if v is None else v


def _in_order(order: pa.Array) -> bool:
    """Whether sort indices are 0, 1, 2, …: the rows were in order already."""
    return bool(np.array_equal(order.to_numpy(), np.arange(len(order))))


def _pieces(rows: int, nbytes: int, runs: list[tuple[int, int]], most: int) -> list[list[tuple[int, int]]]:
    """``runs`` (row groups) dealt into at most ``most`` pieces of consecutive runs, about
    even in rows, each of at least :data:`SPLIT_FROM` bytes (one piece below that)."""
    k = min(most, len(runs)) if nbytes >= SPLIT_FROM else 1
    if k <= 1:
        return [runs]
    pieces: list[list[tuple[int, int]]] = [[]]
    for lo, hi in runs:
        if pieces[-1] and len(pieces) < k and lo >= rows * len(pieces) / k:
            pieces.append([])
        pieces[-1].append((lo, hi))
    return pieces


def _wide_binary(kind: pa.DataType) -> bool:
    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))


def _runs(data: pa.Table, columns: list[str], least: int, most: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of ``data`` (sorted by ``columns``) for its row groups: a
    range ends where those columns change value once it holds ``least`` rows, and holds
    at most ``most``."""
    n = data.num_rows
    changes = np.zeros(max(n - 1, 0), dtype=bool)
    for name in columns:
        after, before = data.column(name).slice(1), data.column(name).slice(0, n - 1)
        differ = pc.not_equal(after, before).fill_null(True)  # null beside a value differs
        both_null = pc.and_(pc.is_null(after), pc.is_null(before))
        changes |= pc.and_not(differ, both_null).to_numpy(zero_copy_only=False)
    cuts = [*(np.nonzero(changes)[0] + 1).tolist(), n]
    out: list[tuple[int, int]] = []
    lo = 0
    for cut in cuts:
        while cut - lo > most:
            out.append((lo, lo + most))
            lo += most
        if cut - lo >= least or cut == n:
            if cut > lo:
                out.append((lo, cut))
            lo = cut
    return out


def _stats(data: pa.Table) -> dict[str, Any]:
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in data.schema:
        if not any(is_type(field.type) for is_type in _STATS_TYPES):
            continue
        col = data[field.name]
        nulls[field.name] = col.null_count
        if col.null_count == len(col):
            continue
        if pa.types.is_string(field.type) and pc.max(pc.utf8_length(col)).as_py() > STATS_STRING_CHARS:
            continue
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        mins[field.name] = lo.isoformat() if hasattr(lo, "isoformat") else lo
        maxs[field.name] = hi.isoformat() if hasattr(hi, "isoformat") else hi
    return {"numRecords": data.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


def _actions(entry: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in entry.decode("utf-8").splitlines() if line.strip()]


def _txn_of(entry: bytes) -> str | None:
    for action in _actions(entry):
        if "commitInfo" in action:
            txn = action["commitInfo"].get("txnId")
            return str(txn) if txn is not None else None
    return None


def _changes_table(entry: bytes) -> bool:
    return any("metaData" in a or "protocol" in a for a in _actions(entry))


__all__ = ["BlindAppender", "LiveFile", "Unsupported", "VersionTaken"]
