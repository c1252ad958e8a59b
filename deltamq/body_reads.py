"""Bodies read where they lie: a listener worker decodes the ``commit_log`` rows of its
own chunks from the Parquet files, so a large deliver pass moves no body through the
broker or a pipe.

Deliver (``deliver_files``) hands a worker each chunk's small columns (the index's:
ids, queue, offset, tags, ...) with two more, :data:`FILE` and :data:`ROW`: which file
of :class:`BodyFiles` holds the message and at which row. The worker reads the body
columns of the row groups holding those rows, a row group once for all the chunks it
serves (:class:`BodyReader` keeps the last few decoded), and builds the chunk its
listener gets, the same columns in the same order as a chunk sent whole.

Only for local warehouses: a row group is read with one seek on a disk, but would cost
a ranged GET per group (and per worker) on an object store, where one GET of the whole
file is cheaper (``delta_read.FileSnapshot`` reads them whole there too).

Imports only the standard library, numpy and pyarrow at module level (workers start fast);
the storage seam and the snapshot reader's pool are imported when first needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from deltamq.storage import Storage

FILE = "_body_file"
"""A chunk's column: the index in :attr:`BodyFiles.paths` of the file holding the row."""
ROW = "_body_row"
"""A chunk's column: the row's position in its file."""
KEEP_FOOTERS = 256
"""Files whose footers a worker keeps (read again when needed past that)."""
KEEP_BYTES = 64 << 20
"""Decoded row groups a worker keeps (least recently used out first): a chunk of 1 000
takes an eighth of a producer's row group of 8 192, so the next chunks find it decoded."""
STREAM_FROM = 16_384
"""Rows of a row group above which a worker reads it as a stream (:class:`_Stream`),
front to back in batches of :data:`STREAM_BATCH`, decoded rows held from its current
chunk on, when the pass's rows come in the files' order (:attr:`BodyFiles.stream_from`:
``deliver_files.by_place``), so that each group is streamed once per consumer group. An
engine's file holds one group of ~100 000 1 KiB bodies: decoded whole it is a fresh
100 MB allocation faulted in page by page, 0.1-0.6 s; streamed, 0.03 s (measured on 2
cores, mimalloc and jemalloc alike). Rows in queue order (an orderly pass) would restart
the stream for every queue: their groups are decoded whole and kept."""
STREAM_BATCH = 2_048
"""Rows a stream decodes at a time (4 096 and more made jemalloc map fresh memory for
each batch again: 0.07-0.1 s per group)."""
KEEP_STREAMS = 2
"""Streams a worker keeps open (least recently used closed first). A stream not read to
its group's end holds the group's column chunks as read from the file (pyarrow's reader
reads a column chunk whole): up to a group's size each, in an idle worker too."""


@dataclass(frozen=True)
class BodyFiles:
    """Where a pass's bodies lie: the warehouse (a local path), the ``commit_log`` files
    (paths) a chunk's :data:`FILE` column points into, and the columns to read with their
    types."""

    location: str
    paths: tuple[str, ...]
    schema: pa.Schema
    stream_from: int | None = None
    """Set when the rows come in each file's row order, a file's rows together (per
    consumer group): row groups of more rows are streamed (:data:`STREAM_FROM`, chosen
    by the broker); None: none is."""


class BodyReader:
    """A worker's reads of row groups, kept between chunks and calls (files never change:
    a Delta data file is written once)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        from deltamq.delta_read import BytePool

        self._storage: Storage | None = None
        self._starts: dict[str, tuple[Any, np.ndarray]] = {}
        self._groups = BytePool(keep_bytes)
        self._streams: OrderedDict[tuple[str, int], _Stream] = OrderedDict()

    def resolve(self, chunk: pa.RecordBatch, files: BodyFiles, order: tuple[str, ...]) -> pa.RecordBatch:
        """``chunk`` with its bodies: the :data:`FILE` / :data:`ROW` columns replaced by
        ``files``' columns at those rows, the columns in ``order``; ValueError where a
        row holds another message than the chunk's (its ``msg_id``, when both have one)."""
        which = chunk.column(FILE).to_numpy(zero_copy_only=False).astype(np.int64)
        rows = chunk.column(ROW).to_numpy(zero_copy_only=False).astype(np.int64)
        group = np.zeros(len(rows), dtype=np.int64)
        for f in np.unique(which):
            mine = which == f
            _, starts = self._layout(files, files.paths[f])
            group[mine] = np.searchsorted(starts, rows[mine], side="right") - 1
        # segments of rows in one row group of one file: a slice where the rows are
        # consecutive (a producer's file, ordered by queue), else the rows taken
        cuts = np.flatnonzero((np.diff(which) != 0) | (np.diff(group) != 0)) + 1
        pieces = []
        for lo, hi in zip(np.concatenate([[0], cuts]), np.append(cuts, len(rows)), strict=True):
            path = files.paths[which[lo]]
            meta, starts = self._layout(files, path)
            g = int(group[lo])
            at = rows[lo:hi] - starts[g]
            if files.stream_from is not None and meta.row_group(g).num_rows > files.stream_from:
                pieces.append(self._streamed(files, path, meta, g, at))
            else:
                pieces.append(_rows_at(self._group(files, path, meta, g), at))
        # one piece (a chunk within one row group) is used as it is: slices, not copies
        bodies = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces).combine_chunks()
        if "msg_id" in bodies.column_names and "msg_id" in chunk.schema.names:
            _same_messages(bodies.column("msg_id"), chunk.column("msg_id"), files, which, rows)
            bodies = bodies.drop_columns(["msg_id"])
        columns = {name: chunk.column(name) for name in chunk.schema.names}
        for name in bodies.column_names:
            column = bodies.column(name)  # (a group of over 2 GiB of bodies comes in chunks)
            columns[name] = column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)
        return pa.RecordBatch.from_arrays([columns[n] for n in order], names=list(order))

    def _store(self, files: BodyFiles) -> Storage:
        if self._storage is None or self._storage.location != files.location:
            from deltamq.arrow_memory import use_pool
            from deltamq.storage import Storage

            # a worker that decodes row groups does it on jemalloc unless told otherwise:
            # on mimalloc, deliver of a million bodies from an engine's files took 3.8-4.4 s
            # against 1.9-2.6 s, of a producer's files the same (deltamq/arrow_memory.py)
            use_pool("auto")
            self._storage = Storage(files.location)
        return self._storage

    def _layout(self, files: BodyFiles, path: str) -> tuple[Any, np.ndarray]:
        found = self._starts.get(path)
        if found is None:
            if len(self._starts) >= KEEP_FOOTERS:  # a long-lived worker meets ever more files
                self._starts.clear()
            from deltamq.delta_read import group_starts

            meta = self._store(files).parquet_metadata(path)
            found = self._starts[path] = (meta, group_starts(meta))
        return found

    def _group(self, files: BodyFiles, path: str, meta: Any, index: int) -> pa.Table:
        key = (path, index)
        data = self._groups.use(key)
        if data is None:
            data = self._store(files).read_parquet(path, files.schema, (meta, index))
            self._groups.keep(key, data, data.nbytes)
        return data

    def _streamed(self, files: BodyFiles, path: str, meta: Any, index: int, at: np.ndarray) -> pa.Table:
        """Rows ``at`` (in that order) of a large row group, from its stream; the group
        streamed again from its start when a row lies behind the stream."""
        key = (path, index)
        stream = self._streams.pop(key, None)
        lo = int(at.min())
        if stream is None or stream.passed(lo):
            if stream is not None:
                stream.close()
            batches = self._store(files).parquet_batches(path, files.schema, (meta, index), STREAM_BATCH)
            stream = _Stream(batches, meta.row_group(index).num_rows)
        self._streams[key] = stream  # most recently used last
        while len(self._streams) > KEEP_STREAMS:
            self._streams.popitem(last=False)[1].close()
        return stream.rows(at)


class _Stream:
    """One row group read front to back, holding its decoded batches from the lowest row
    still wanted on (rows behind it are gone: asking for them again starts a new one).
    Read to the group's end, it closes its file."""

    def __init__(self, batches: Iterator[pa.Table], rows: int) -> None:
        self._batches: Iterator[pa.Table] | None = batches
        self._rows = rows
        self._held: list[pa.Table] = []
        self._first = 0  # the group row the first held batch starts at
        self._end = 0  # the group row after the last one decoded

    def passed(self, lo: int) -> bool:
        """Whether row ``lo`` lies behind what the stream still holds."""
        return lo < self._first

    def rows(self, at: np.ndarray) -> pa.Table:
        """The group's rows ``at`` (none behind the stream: :meth:`passed`), in that
        order: rows of one batch in a run, a slice where they are consecutive, else
        taken; the held batches before the lowest row dropped."""
        lo, hi = int(at.min()), int(at.max()) + 1
        while self._held and self._first + self._held[0].num_rows <= lo:
            self._first += self._held.pop(0).num_rows
        while self._end < hi and self._batches is not None:
            batch = next(self._batches, None)
            if batch is not None:
                self._end += batch.num_rows
                if self._end <= lo:  # wholly before the rows wanted: not kept
                    self._first = self._end
                else:
                    self._held.append(batch)
            if batch is None or self._end >= self._rows:
                self.close()
        if hi > self._end:
            raise IndexError(f"row {hi - 1} asked of a row group of {self._end}")
        starts = self._first + np.cumsum([0] + [b.num_rows for b in self._held[:-1]])
        which = np.searchsorted(starts, at, side="right") - 1
        cuts = np.flatnonzero(np.diff(which) != 0) + 1
        pieces = [
            _rows_at(self._held[int(which[a])], at[a:b] - starts[which[a]])
            for a, b in zip(np.concatenate([[0], cuts]), np.append(cuts, len(at)), strict=True)
        ]
        return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)

    def close(self) -> None:
        """Closes the file (the decoded batches held stay)."""
        if self._batches is not None:
            close = getattr(self._batches, "close", None)
            if close is not None:
                close()
            self._batches = None


def _rows_at(data: pa.Table, at: np.ndarray) -> pa.Table:
    """``data``'s rows ``at`` (not empty), in that order: a slice where they are
    consecutive (no copy of the bodies), else taken."""
    n = len(at)
    if at[-1] - at[0] == n - 1 and (n == 1 or bool(np.all(np.diff(at) == 1))):
        return data.slice(int(at[0]), n)
    return data.take(pa.array(at, pa.int64()))


def _same_messages(stored: Any, wanted: Any, files: BodyFiles, which: np.ndarray, rows: np.ndarray) -> None:
    """Raises ValueError, naming the file and row, where a row found by its batch id and
    position holds another message than the index row (never expected: batch ids are
    unique; the engine's join would have left such a row out)."""
    import pyarrow.compute as pc

    same = pc.equal(stored, wanted).fill_null(False)
    if pc.all(same).as_py():
        return
    k = pc.index(same, False).as_py()
    raise ValueError(
        f"{files.paths[which[k]]} row {rows[k]} holds message {stored[k].as_py()}, "
        f"not {wanted[k].as_py()} as the index says"
    )
