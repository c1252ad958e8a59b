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


@dataclass(frozen=True)
class BodyFiles:
    """Where a pass's bodies lie: the warehouse (a local path), the ``commit_log`` files
    (paths) a chunk's :data:`FILE` column points into, and the columns to read with their
    types."""

    location: str
    paths: tuple[str, ...]
    schema: pa.Schema


class BodyReader:
    """A worker's reads of row groups, kept between chunks and calls (files never change:
    a Delta data file is written once)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        from deltamq.delta_read import BytePool

        self._storage: Storage | None = None
        self._starts: dict[str, tuple[Any, np.ndarray]] = {}
        self._groups = BytePool(keep_bytes)

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
            data = self._group(files, path, meta, g)
            at = rows[lo:hi] - starts[g]
            if at[-1] - at[0] == hi - lo - 1 and (hi - lo == 1 or bool(np.all(np.diff(at) == 1))):
                pieces.append(data.slice(int(at[0]), int(hi - lo)))
            else:
                pieces.append(data.take(pa.array(at, pa.int64())))
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
            from deltamq.storage import Storage

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
