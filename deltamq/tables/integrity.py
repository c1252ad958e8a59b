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
Local warehouses only (``file://`` or a path): an object store does not truncate.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

from deltamq.errors import DeltaMQError, TableDamaged
from deltamq.schemas import TABLES

if TYPE_CHECKING:
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


def _check(table: str, path: str, expected: int | None) -> Damage | None:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return Damage(table, path, "missing", expected or 0, None)
    if expected is not None and size != expected:
        return Damage(table, path, "truncated", expected, size)
    return None


def damaged_files(warehouse: Warehouse, tables: list[str] | None = None) -> list[Damage]:
    """Every live data file of ``tables`` (default: all) that is missing or not the size
    the Delta log recorded. Tables not created yet are skipped."""
    import pyarrow as pa
    from deltalake import DeltaTable

    if not warehouse.is_local:
        return []
    out: list[Damage] = []
    for table in tables or list(TABLES):
        root = os.path.join(warehouse.local_path, table)
        if not os.path.isdir(os.path.join(root, "_delta_log")):
            continue
        adds = pa.table(DeltaTable(root).get_add_actions(flatten=True)).select(["path", "size_bytes"])
        for add in adds.to_pylist():
            rel = unquote(add["path"])
            damage = _check(table, rel if os.path.isabs(rel) else os.path.join(root, rel), add["size_bytes"])
            if damage:
                out.append(damage)
    return out


def check_added(table: str, files: list[AddedFile]) -> None:
    """Raise TableDamaged if any of ``files`` (read from the log, local) is missing or
    truncated. A job that reads a list of files calls this first: an engine may skip a
    file that is not there instead of failing, which would lose its rows silently."""
    damage = [d for f in files if (d := _check(table, f.path, f.size))]
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


def diagnose(warehouse: Warehouse, error: BaseException) -> BaseException:
    """``TableDamaged`` (chained from ``error``) if ``error`` came from a damaged data
    file, else ``error`` itself."""
    if isinstance(error, DeltaMQError) or not _FILE_ERROR.search(str(error)):
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


__all__ = ["Damage", "check_added", "damaged_files", "diagnose", "table_damaged"]
