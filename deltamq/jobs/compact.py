"""Compaction and log hygiene, run by the retain job after each retention pass.

Sail has no ``OPTIMIZE`` or ``VACUUM`` (docs/engines.md), so this goes through delta-rs
(the ``deltalake`` package), verified on these tables: Sail reads them unchanged after
compaction, time travel to earlier versions keeps working until their files are
vacuumed, and dispatch skips compaction commits (they remove files: not blind appends).

- **Compaction** bin-packs small files: ``commit_log`` and ``job_runs`` on closed days
  only (producers and tick records append to today's), every other table whole (their
  files are small and rewritten by MERGE all the time). Files already at the target
  size are left alone, so the cost follows what was written since the last pass.
- **Checkpoints** after compaction, so log replay stays short.
- **Vacuum** ("full") removes files the current version does not use once their
  modification is ``vacuum_retention_ms`` (24 h) old, and, while a remove tombstone
  still covers a file, its removal too. Tombstones expire after ``log_retention_ms``
  (below), so an old file compacted away goes at a later pass, not 24 h after its
  removal: ``commit_log`` days holding commits dispatch has not read (it reads the
  files each commit added) are not compacted until it has.
- **Tombstones**: every MERGE leaves a remove action, and each checkpoint carries those
  until ``delta.deletedFileRetentionDuration`` (Delta's default: a week) has passed —
  ``offsets`` gains ~6 a tick, and its checkpoint is read at every snapshot load (after
  1 000 ticks: 6 690 tombstones beside 3 live files, idle tick 0.36 s → 0.19 s once
  dropped). Every table is created with ``delta.deletedFileRetentionDuration`` =
  ``log_retention_ms`` (a writer option; older tables get it at the next pass), and
  Sail's and delta-rs's checkpoints both honour it; nothing needs
  tombstones longer: readers of an older snapshot still find the files until vacuum, and
  time travel reads the commit entries, which log cleanup keeps as long.
- **Log cleanup** deletes commit entries (``<v>.json``, ``.crc``) and older checkpoints
  below each table's newest checkpoint once they are ``log_retention_ms`` old (60 s,
  wall clock, so a reader that listed the log a moment ago still finds its entries);
  it runs after each pass and, being a few directory listings, also from every tick's
  retain step whenever half of ``log_retention_ms`` has passed (``cleanup_logs_if_due``);
  for ``commit_log`` only entries dispatch has already read. Readers start from the
  newest checkpoint, so nothing they need goes; time travel (through delta-rs — Sail
  cannot reach versions behind its newest checkpoint anyway) reaches back that far. Every
  tick adds several commits to the hot tables (``offsets`` ~6) and reading a table
  lists its log, so without this an idle tick slowed from 0.19 s to 0.27 s over 800
  ticks (bench/README.md).

A compaction that loses a race with a writer (its commit refused) is skipped until the
next pass; it changes no data, so nothing is lost either way.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deltamq import ids
from deltamq.config import TOMBSTONE_RETENTION, tombstone_retention
from deltamq.tables.consume_queue import load_dispatch_state, undispatched_days

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.storage import Storage

log = logging.getLogger(__name__)

# tables whose partitions are by day and receive appends today: only closed days compacted
_BY_DAY = {"commit_log": "store_date", "job_runs": "run_date"}
_LOG_ENTRY = re.compile(r"^(\d{20})\.(json|crc|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?\.parquet$")


def cleanup_log(storage: Storage, table_path: str, *, keep_from: int | None, older_than_s: float) -> int:
    """Delete the Delta log entries of ``table_path`` that no reader needs: versions below
    the newest checkpoint (and below ``keep_from``, when given), modified before
    ``older_than_s`` (epoch seconds); older checkpoints likewise. Returns files deleted."""
    log_dir = table_path + "/_delta_log"
    entries = storage.list(log_dir)
    names = [e.name for e in entries]
    checkpoints = [int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n))]
    if not checkpoints:
        return 0
    newest = max(checkpoints)
    bound = newest if keep_from is None else min(newest, keep_from)
    deleted = 0
    for e in entries:
        m = _LOG_ENTRY.match(e.name)
        if not m:
            continue
        version = int(m.group(1))
        is_checkpoint = _CHECKPOINT.match(e.name) is not None
        if (version >= newest) if is_checkpoint else (version >= bound):
            continue
        if e.mtime_s is None or e.mtime_s >= older_than_s:
            continue
        # False: another cleanup got there first
        deleted += storage.delete(f"{log_dir}/{e.name}")
    return deleted


@dataclass(frozen=True, kw_only=True)
class CompactResult:
    files_removed: int = 0
    files_added: int = 0
    vacuumed: int = 0
    conflicts: int = 0
    log_entries_removed: int = 0
    per_table: dict[str, int] = field(default_factory=dict)  # files removed by compaction

    @property
    def details(self) -> dict[str, int]:
        return {
            "compact_files_removed": self.files_removed,
            "compact_files_added": self.files_added,
            "vacuumed_files": self.vacuumed,
            "compact_conflicts": self.conflicts,
            "log_entries_removed": self.log_entries_removed,
        }


def run(
    ctx: Context, now: int, memory: LogCleanupMemory | None = None, *, vacuum: bool = True
) -> CompactResult:
    from deltamq.schemas import TABLES

    wh = ctx.warehouse
    today = ids.store_date(now).isoformat()
    hours = max(0, ctx.config.vacuum_retention_ms // 3_600_000)
    removed = added = vacuumed = conflicts = 0
    wanted = tombstone_retention(ctx.config)
    per_table: dict[str, int] = {}
    for name in TABLES:
        if not wh.table_exists(name):
            continue
        table = wh.delta_rs(name)
        try:
            # tables created before this setting (or with another log_retention_ms) get it
            # here: a pass commits anyway, an idle tick must not
            _set_tombstone_retention(table, name, wanted)
            filters: list[tuple[str, str, Any]] | None = (
                [(_BY_DAY[name], "<", today)] if name in _BY_DAY else None
            )
            if name == "commit_log" and filters:
                # days holding commits dispatch has not read stay as written: it reads the
                # files each commit added, and vacuum may delete a compacted-away file soon
                # after its tombstone expires (log_retention_ms), whatever its age
                waiting = sorted(undispatched_days(wh))
                if waiting:
                    filters.append(("store_date", "not in", waiting))
            metrics = table.optimize.compact(partition_filters=filters)
            n_removed = int(metrics.get("numFilesRemoved") or 0)
            removed += n_removed
            added += int(metrics.get("numFilesAdded") or 0)
            per_table[name] = n_removed
            if n_removed:
                table.create_checkpoint()
            if vacuum:
                vacuumed += len(
                    table.vacuum(
                        retention_hours=hours, enforce_retention_duration=False, dry_run=False, full=True
                    )
                )
        except Exception as e:  # noqa: BLE001 - a lost race: the next pass compacts it
            if not _lost_race(e):
                raise wh.storage.error(f"compact table {name} at", wh.uri(name), e) from e
            conflicts += 1
            log.info("compaction of %s skipped this pass: %s", name, e)
    logs = cleanup_logs(ctx, memory)
    return CompactResult(
        files_removed=removed,
        files_added=added,
        vacuumed=vacuumed,
        conflicts=conflicts,
        log_entries_removed=logs,
        per_table=per_table,
    )


_RACE = re.compile(r"concurrent|already exists|conflict|Transaction failed|version mismatch", re.IGNORECASE)


def _lost_race(e: Exception) -> bool:
    """True for delta-rs' refusal of a commit that lost a race with another writer; not
    for a store it cannot reach or a file it cannot read (those must be heard)."""
    name = type(e).__name__
    return name == "CommitFailedError" or (name == "DeltaError" and _RACE.search(str(e)) is not None)


def _set_tombstone_retention(table: Any, name: str, wanted: str) -> bool:
    """Set :data:`TOMBSTONE_RETENTION` on a delta-rs ``table`` unless it has ``wanted``;
    True when it committed. A lost race is left for the next pass."""
    if table.metadata().configuration.get(TOMBSTONE_RETENTION) == wanted:
        return False
    try:
        table.alter.set_table_properties({TOMBSTONE_RETENTION: wanted})
    except Exception as e:  # noqa: BLE001 - a concurrent commit: the next pass sets it
        if not _lost_race(e):
            raise
        log.info("tombstone retention of %s not set this pass: %s", name, e)
        return False
    return True


def set_tombstone_retention(ctx: Context) -> int:
    """Set :data:`TOMBSTONE_RETENTION` (a metadata commit through delta-rs) on every table
    that lacks this broker's value, as each compaction pass does; returns the tables
    changed."""
    from deltamq.schemas import TABLES

    wanted = tombstone_retention(ctx.config)
    return sum(
        _set_tombstone_retention(ctx.warehouse.delta_rs(name), name, wanted)
        for name in TABLES
        if ctx.warehouse.table_exists(name)
    )


def cleanup_logs(ctx: Context, memory: LogCleanupMemory | None = None) -> int:
    """Log cleanup of every table (see the module docstring); returns entries deleted."""
    from deltamq.schemas import TABLES

    wh = ctx.warehouse
    older_than_s = time.time() - ctx.config.log_retention_ms / 1000.0
    dispatched = load_dispatch_state(wh).version  # commit_log entries after it are still to read
    deleted = 0
    for name in TABLES:
        if name == "commit_log" and dispatched < 0:
            continue  # dispatch has read nothing yet: every entry is still needed
        keep_from = dispatched + 1 if name == "commit_log" else None
        deleted += cleanup_log(wh.storage, wh.uri(name), keep_from=keep_from, older_than_s=older_than_s)
    if memory is not None:
        memory.log_cleanup_wall = time.time()
    return deleted


class LogCleanupMemory(Protocol):
    """Where the wall time of the last log cleanup is kept between ticks (retain's memory)."""

    log_cleanup_wall: float | None


def cleanup_logs_if_due(ctx: Context, memory: LogCleanupMemory) -> int:
    """:func:`cleanup_logs` when half of ``log_retention_ms`` (wall clock, at least a second)
    has passed since ``memory`` last saw it run; 0 otherwise. Cheap: a listing per table."""
    last = memory.log_cleanup_wall
    every_s = max(1.0, ctx.config.log_retention_ms / 2000.0)
    if last is not None and time.time() - last < every_s:
        return 0
    return cleanup_logs(ctx, memory)
