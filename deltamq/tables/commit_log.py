"""The ``commit_log`` table's reads: what new commits added, and the days it holds.

Messages reach ``commit_log`` by blind appends (``Warehouse.append``; the producers,
promote, send-back and check-back each append their own rows). Readers of new data go
through here: :func:`read_added` reads the files a list of Delta commits added, mapped
to the commit version each row came from, so a reader's cost follows new data.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from deltamq.constants import SysFlag
from deltamq.schemas import SCHEMA_VERSION, TABLES
from deltamq.tables import deltalog
from deltamq.tables.integrity import check_added

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

# commit_log columns stored inside the Parquet files (partition columns are not).
_FILE_SCHEMA = T.StructType(
    [f for f in TABLES["commit_log"].columns_at(SCHEMA_VERSION).fields if f.name != "store_date"]
)


def file_batch(f: deltalog.AddedFile) -> int | None:
    """The one producer batch a file holds, by its ``batch_id`` statistics (None: the
    statistics are missing or the file holds several batches)."""
    lo, hi = f.min_values.get("batch_id"), f.max_values.get("batch_id")
    return lo if lo is not None and lo == hi else None


def batch_ids(commits: list[deltalog.Commit]) -> tuple[set[int], bool]:
    """The producer batches the commits' files hold (:func:`file_batch`), and whether
    that is all of them and each batch is in one commit only. One commit may spread a
    batch over several files (an engine write of a large send): one write stores each
    row once, so only a batch seen in two commits may repeat rows."""
    seen: dict[int, set[int]] = defaultdict(set)
    exact = True
    for c in commits:
        for f in c.files:
            batch = file_batch(f)
            if batch is None:
                exact = False
            else:
                seen[batch].add(c.version)
    return set(seen), exact and all(len(v) == 1 for v in seen.values())


def read_added(wh: Warehouse, commits: list[deltalog.Commit]) -> DataFrame | None:
    """commit_log rows added by ``commits`` with their ``cl_version``.

    Files are read in one scan and mapped to their version through the ``batch_id``
    statistics of each added file (one batch per producer commit). Files whose
    statistics cannot say (missing stats, a batch id seen in two versions) are read
    per version instead. A file that is missing or truncated stops the reader before it
    reads (TableDamaged): Sail skips a missing path in a file list silently.
    """
    spark = wh.engine.spark
    check_added(wh.storage, "commit_log", [f for c in commits for f in c.files])
    by_batch: dict[int, set[int]] = defaultdict(set)
    stat_files: list[tuple[int, deltalog.AddedFile, int]] = []
    odd: dict[int, list[str]] = defaultdict(list)
    for c in commits:
        for f in c.files:
            batch = file_batch(f)
            if batch is not None:
                stat_files.append((c.version, f, batch))
                by_batch[batch].add(c.version)
            else:
                odd[c.version].append(wh.engine_path(f.path))
    mapped: list[tuple[int, int]] = []
    mapped_paths: list[str] = []
    for version, f, batch in stat_files:
        if len(by_batch[batch]) > 1:
            odd[version].append(wh.engine_path(f.path))
        else:
            mapped.append((batch, version))
            mapped_paths.append(wh.engine_path(f.path))
    parts: list[DataFrame] = []
    if mapped_paths:
        versions = spark.createDataFrame(sorted(set(mapped)), "batch_id bigint, cl_version bigint")
        data = spark.read.schema(_FILE_SCHEMA).parquet(*mapped_paths)
        parts.append(data.join(F.broadcast(versions), "batch_id"))
    for version, paths in sorted(odd.items()):
        parts.append(
            spark.read.schema(_FILE_SCHEMA)
            .parquet(*paths)
            .withColumn("cl_version", F.lit(version).cast("bigint"))
        )
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def may_hold_commits(commits: list[deltalog.Commit]) -> bool:
    """Whether the commits' files may hold committed transactional messages (``sys_flag``
    statistics ≥ the commit type; a file without statistics may)."""
    return any(
        (f.max_values.get("sys_flag") is None or f.max_values["sys_flag"] >= SysFlag.TRANSACTION_COMMIT_TYPE)
        for c in commits
        for f in c.files
    )


def only_appended(commit: deltalog.Commit, rows: int) -> bool:
    """Whether ``commit`` is a blind append of exactly ``rows`` rows (file statistics)."""
    counts = [f.num_records for f in commit.files]
    if commit.rewrite or not counts or any(n is None for n in counts):
        return False
    return sum(n for n in counts if n is not None) == rows


def days_before(wh: Warehouse, day: date) -> list[date]:
    """The ``store_date`` partitions older than ``day``."""
    return [
        r["store_date"]
        for r in wh.engine.rows(
            f"SELECT DISTINCT store_date FROM {wh.ref('commit_log')} "
            f"WHERE store_date < DATE'{day.isoformat()}'"
        )
    ]
