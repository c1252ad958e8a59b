"""Reading what Delta commits added, from the table's ``_delta_log`` commit entries.

This is behind the engine seam on purpose: it reads the standard Delta commit JSON
(``<version>.json``: ``commitInfo``, ``add``, ``remove``) that every engine writes, so
dispatch can find exactly the rows committed after a version without scanning the
table. Only blind appends count as new rows: a commit that removes files (retention,
compaction) re-adds rows that were already there and is skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltamq.errors import DeltaMQError

if TYPE_CHECKING:
    from deltamq.storage import Storage

_COMMIT_FILE = re.compile(r"^(\d{20})\.json$")


@dataclass(frozen=True)
class AddedFile:
    path: str  # absolute
    partition_values: dict[str, str | None]
    num_records: int | None
    min_values: dict[str, Any]
    max_values: dict[str, Any]
    size: int | None = None  # bytes, as the log recorded it
    tags: dict[str, str] | None = None  # the add action's per-file metadata


@dataclass(frozen=True)
class Commit:
    version: int
    operation: str
    files: tuple[AddedFile, ...]
    skipped_files: int  # adds of non-append commits (rewrites)
    rewrite: bool = False  # the commit removed files (retention, compaction, DML)


class LogGap(DeltaMQError, RuntimeError):
    """Commit entries the reader needs were already removed by Delta log cleanup."""


def latest_version(storage: Storage, table_path: str) -> int:
    """Highest committed version (−1 for a missing table)."""
    versions = _versions(storage, table_path)
    return versions[-1] if versions else -1


def _versions(storage: Storage, table_path: str) -> list[int]:
    names = [e.name for e in storage.list(table_path + "/_delta_log")]
    return sorted(int(m.group(1)) for n in names if (m := _COMMIT_FILE.match(n)))


def first_version(storage: Storage, table_path: str) -> int:
    """Lowest commit entry still in the log (−1 for a missing table)."""
    versions = _versions(storage, table_path)
    return versions[0] if versions else -1


def latest_versions(storage: Storage, tables: dict[str, str], known: dict[str, int]) -> dict[str, int]:
    """Each table's highest committed version (``tables``: name → path; −1 for a missing
    table), found from the ``known`` versions by looking for the next commit entries: one
    look-up for a table that did not change, one more per new commit. A table not in
    ``known`` is listed. On an object store the
    look-ups run in parallel."""

    def latest(name: str) -> int:
        path = tables[name]
        version = known.get(name)
        if version is None:
            return latest_version(storage, path)
        while True:
            if not storage.exists(f"{path}/_delta_log/{version + 1:020d}.json"):
                return version
            version += 1

    names = list(tables)
    if storage.is_local or len(names) < 2:
        return {name: latest(name) for name in names}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        return dict(zip(names, pool.map(latest, names), strict=True))


def commits_after(storage: Storage, table_path: str, after_version: int, limit: int) -> list[Commit]:
    """Commits with version > ``after_version`` (at most ``limit``), in version order.
    ``table_path`` is the table's location as ``storage`` names it (a path or a URI)."""
    listed = [v for v in _versions(storage, table_path) if v > after_version]
    if listed and listed[0] != after_version + 1 and after_version >= 0:
        # the next entry is not listed: gone (log cleanup), or missed by a listing racing
        # its commit (list again before calling it gone)
        listed = [v for v in _versions(storage, table_path) if v > after_version]
        if listed and listed[0] != after_version + 1:
            raise LogGap(
                f"{table_path}: commit entries {after_version + 1}..{listed[0] - 1} are gone "
                "(Delta log cleanup); the reader fell behind the log retention"
            )
    versions = _contiguous(listed)[:limit]
    if storage.is_local or len(versions) < 2:
        return [read_commit(storage, table_path, v) for v in versions]
    # an object store answers each GET in milliseconds, not microseconds: read in parallel
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, len(versions))) as pool:
        return list(pool.map(lambda v: read_commit(storage, table_path, v), versions))


def _contiguous(versions: list[int]) -> list[int]:
    """The versions up to the first one missing. Delta versions are created in order, so a
    hole is a listing that raced a commit (a local directory lists in hash order and can
    show a new entry without the one before it): what follows it is read next time,
    never skipped."""
    for i in range(1, len(versions)):
        if versions[i] != versions[i - 1] + 1:
            return versions[:i]
    return versions


def read_commit(storage: Storage, table_path: str, version: int) -> Commit:
    path = f"{table_path}/_delta_log/{version:020d}.json"
    operation = ""
    adds: list[AddedFile] = []
    removes = 0
    for line in storage.read_text(path).splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "commitInfo" in action:
            operation = action["commitInfo"].get("operation", "")
        elif "remove" in action:
            removes += 1
        elif "add" in action:
            add = action["add"]
            if not add.get("dataChange", True):
                continue
            stats = json.loads(add["stats"]) if add.get("stats") else {}
            adds.append(
                AddedFile(
                    path=storage.absolute(table_path, add["path"]),
                    partition_values=add.get("partitionValues") or {},
                    num_records=stats.get("numRecords"),
                    min_values=stats.get("minValues") or {},
                    max_values=stats.get("maxValues") or {},
                    size=add.get("size"),
                    tags=add.get("tags") or None,
                )
            )
    if removes:
        return Commit(version, operation, (), len(adds), rewrite=True)
    return Commit(version, operation, tuple(adds), 0)
