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
- **Vacuum** removes files no version newer than ``vacuum_retention_ms`` (24 h) still
  references: time travel reaches back that far.

A compaction that loses a race with a writer (its commit refused) is skipped until the
next pass; it changes no data, so nothing is lost either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltamq import ids

if TYPE_CHECKING:
    from deltamq.broker import Broker

log = logging.getLogger(__name__)

# tables whose partitions are by day and receive appends today: only closed days compacted
_BY_DAY = {"commit_log": "store_date", "job_runs": "run_date"}


@dataclass(frozen=True)
class CompactResult:
    files_removed: int = 0
    files_added: int = 0
    vacuumed: int = 0
    conflicts: int = 0
    per_table: dict[str, int] = field(default_factory=dict)  # files removed by compaction

    @property
    def details(self) -> dict[str, int]:
        return {
            "compact_files_removed": self.files_removed,
            "compact_files_added": self.files_added,
            "vacuumed_files": self.vacuumed,
            "compact_conflicts": self.conflicts,
        }


def run(broker: Broker, now: int, *, vacuum: bool = True) -> CompactResult:
    from deltalake import DeltaTable

    from deltamq.schemas import TABLES

    wh = broker.warehouse
    today = ids.store_date(now).isoformat()
    hours = max(0, broker.config.vacuum_retention_ms // 3_600_000)
    removed = added = vacuumed = conflicts = 0
    per_table: dict[str, int] = {}
    for name in TABLES:
        path = wh.local_path + "/" + name
        if not wh.table_exists(name):
            continue
        try:
            table = DeltaTable(path)
            filters = [(_BY_DAY[name], "<", today)] if name in _BY_DAY else None
            metrics = table.optimize.compact(partition_filters=filters)
            n_removed = int(metrics.get("numFilesRemoved") or 0)
            removed += n_removed
            added += int(metrics.get("numFilesAdded") or 0)
            per_table[name] = n_removed
            if n_removed:
                table.create_checkpoint()
            if vacuum:
                vacuumed += len(
                    table.vacuum(retention_hours=hours, enforce_retention_duration=False, dry_run=False)
                )
        except Exception as e:  # noqa: BLE001 - a lost race: the next pass compacts it
            if type(e).__name__ not in ("CommitFailedError", "DeltaError"):
                raise
            conflicts += 1
            log.info("compaction of %s skipped this pass: %s", name, e)
    return CompactResult(removed, added, vacuumed, conflicts, per_table)
