"""Data files the Delta log references but the disk no longer holds whole.

A Parquet file deleted or truncated under a table (a bad copy, a full disk, a hand
``rm``) makes every read that touches it fail deep inside the engine with an object
store or Parquet error. :func:`damaged_files` compares each table's live files (the
``add`` actions of its newest snapshot, read with ``deltalake``) with the disk:
missing, or a size other than the one the log recorded. The tick calls
:func:`diagnose` when a job fails on a data file, so the error names the table, the
file and what is wrong, and ``deltamq doctor`` lists the same. Nothing is repaired
automatically: the rows in such a file exist nowhere else, so the way back is to
restore the file (from a backup or a replica); then the next tick goes on where the
failed one stopped, since a job that fails has committed nothing of its step.
The comparison goes through the storage seam (deltamq/storage.py), so it works the same
on a local path and on an object store, where a deleted object is the usual damage.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltamq.errors import DeltaMQError, TableDamaged
from deltamq.schemas import TABLES
from deltamq.storage import is_transient

if TYPE_CHECKING:
    from deltamq.storage import Storage
    from deltamq.tables.deltalog import AddedFile
    from deltamq.tables.warehouse import Warehouse

# What an engine says when a data file is gone or unreadable (Sail/DataFusion, Spark)
_FILE_ERROR = re.compile(
    r"\.parquet|Object Store error|Parquet error|FileNotFound|No such file|PARQUET|not a Parquet file",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Damage:
    table: str
    path: str
    problem: str  # "missing" or "truncated"
    expected_bytes: int
    actual_bytes: int | None

    def describe(self) -> str:
        if self.problem == "missing":
            return f"table {self.table}: {self.path} is missing ({self.expected_bytes} bytes expected)"
        return (
            f"table {self.table}: {self.path} is {self.actual_bytes} bytes, "
            f"the log recorded {self.expected_bytes} ({self.problem})"
        )


def _check(storage: Storage, table: str, expected: dict[str, int | None]) -> list[Damage]:
    """Damage among files ``expected`` (path → size the log recorded)."""
    out = []
    for path, size in storage.sizes(expected).items():
        want = expected[path]
        if size is None:
            out.append(Damage(table, path, "missing", want or 0, None))
        elif want is not None and size != want:
            out.append(Damage(table, path, "truncated", want, size))
    return out


def damaged_files(warehouse: Warehouse, tables: list[str] | None = None) -> list[Damage]:
    """Every live data file of ``tables`` (default: all) that is missing or not the size
    the Delta log recorded. Tables not created yet are skipped."""
    import pyarrow as pa

    out: list[Damage] = []
    for table in tables or list(TABLES):
        if not warehouse.table_exists(table):
            continue
        root = warehouse.uri(table)
        adds = pa.table(warehouse.delta_rs(table).get_add_actions(flatten=True)).select(
            ["path", "size_bytes"]
        )
        expected = {warehouse.storage.absolute(root, a["path"]): a["size_bytes"] for a in adds.to_pylist()}
        out.extend(_check(warehouse.storage, table, expected))
    return out


def check_added(storage: Storage, table: str, files: list[AddedFile]) -> None:
    """Raise TableDamaged if any of ``files`` (read from the log) is missing or
    truncated. A job that reads a list of files calls this first: an engine may skip a
    file that is not there instead of failing, which would lose its rows silently."""
    damage = _check(storage, table, {f.path: f.size for f in files})
    if damage:
        raise table_damaged(damage)


def table_damaged(damage: list[Damage]) -> TableDamaged:
    lines = "; ".join(d.describe() for d in damage[:5])
    more = f" (and {len(damage) - 5} more)" if len(damage) > 5 else ""
    return TableDamaged(
        f"{len(damage)} data file(s) referenced by the Delta log are damaged: {lines}{more}. "
        "Restore them from a backup or replica; the failed job committed nothing and runs "
        "again on the next tick (`deltamq doctor` lists them)",
        damage,
    )


@contextmanager
def faults_named(warehouse: Warehouse) -> Iterator[None]:
    """Errors of the block pass through :func:`diagnose`: a store fault or a damaged file
    leaves it as the deltamq error that names the warehouse and the cause."""
    try:
        yield
    except Exception as raised:
        named = diagnose(warehouse, raised)
        if named is raised:
            raise
        raise named from raised


def diagnose(warehouse: Warehouse, error: BaseException) -> BaseException:
    """``TableDamaged`` (chained from ``error``) if ``error`` came from a damaged data
    file; a ``StorageError`` naming the warehouse if it is a transient fault of the store
    (throttling, a reset, a server error); else ``error`` itself."""
    if isinstance(error, DeltaMQError):
        return error
    if is_transient(error):
        named = warehouse.storage.error("read from or write to the warehouse at", warehouse.location, error)
        named.__cause__ = error
        return named
    if not _FILE_ERROR.search(str(error)):
        return error
    try:
        damage = damaged_files(warehouse)
    except Exception:  # noqa: BLE001 - the diagnosis must not hide the original error
        return error
    if not damage:
        return error
    damaged = table_damaged(damage)
    damaged.__cause__ = error
    return damaged


__all__ = ["Damage", "check_added", "damaged_files", "diagnose", "faults_named", "table_damaged"]
