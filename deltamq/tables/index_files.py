"""The index of new ``commit_log`` rows built from the tables' files, without the engine.

A dispatch pass through the engine is four statements whatever its size: the new rows
read back (``commit_log.read_added``), a look-up of the batches already indexed, the
insert-only ``MERGE`` into ``consume_queue`` and the read-back of what it indexed. On
an object store each statement also lists the tables' logs and reads their last
checkpoint. A pass of a few thousand rows does all of it here instead: the files the new
commits added are read through the kept ``commit_log`` snapshot (deltamq/delta_read.py;
deliver then finds the same bodies decoded), routed and given their offsets in Arrow,
and appended to ``consume_queue`` as one commit at the version after the one the plan
was read from (``BlindAppender.append(at=…)``). Any commit to the index in between (a
raced indexer, retention, compaction) takes that version: the append is refused as a
commit conflict and the caller's ``Context.commit`` plans the pass again from the new
state, as the engine's ``MERGE`` conflicts. The other order is covered too: the commit
says it is no blind append (it names the version it read), so an engine ``MERGE`` that
read the index before it and commits after it finds its rows among what it should have
read, and conflicts. With Apache Spark on a local disk every commit is the engine's: the
rows are appended by Spark as an idempotent append (:func:`append`).

One plan, two ways: every column is what ``consume_queue.plan_index`` computes through
the engine (the same routes, due times, offsets, ``tags_hash`` as Spark's ``xxhash64``
with seed 42, properties); ``tests/test_index_files.py`` compares them row by row. A
pass is the engine's when these reads cannot be sure to match it: a table the file
reader or appender does not support (on an engine without idempotent appends),
committed transactional messages (their de-duplication is the engine's), or more than
:data:`MAX_ROWS` new rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from deltamq import file_reads, ids
from deltamq.constants import (
    COMMIT_LOG_GROUPS,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    Prop,
    SysFlag,
)
from deltamq.delta_append import ORDERED_BY_TAG, Unsupported
from deltamq.delta_read import DataFile, FileSnapshot
from deltamq.schemas import SCHEMA_VERSION, TABLES
from deltamq.tables import commit_log, deltalog
from deltamq.tables.integrity import check_added

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

MAX_ROWS = 20_000
"""New rows above which a pass is the engine's. Where the two cross, measured on 2 cores
(`bench/bench_index.py`, 1 KiB bodies, one pass after a warm one): 100 rows 0.025 s here
against 0.14 s by the engine, 5 000 rows 0.08 s against 0.15 s, 20 000 alike
(0.17-0.18 s), 50 000 0.27 s against 0.16 s: the engine's statements cost about the same
whatever their size, while here every row costs Python and Arrow time."""
MAX_ORDERED_ROWS = 2_000_000
"""New rows above which a pass is the engine's when every new file says its rows are
ordered by queue (``ORDERED_BY_TAG``: deltamq's own writers, ``send_arrow`` and the
Spark-free producers): the plan keeps the files' order and copies no row. Measured
(`bench/bench_index.py --send arrow`, 2026-11-29): 150 000 rows 0.13 s here against
0.28 s by the engine, 1M 0.47 s against 1.03 s, 2M 0.88 s against 2.89 s; the driver's
memory grows by 340 MB for 1M and 580 MB for 2M (the index columns, no bodies), which
bounds it."""
_BY_QUEUE = ",".join(COMMIT_LOG_GROUPS)
KEEP_DECODED = 10_000
"""New rows up to which their files are decoded whole and kept in the snapshot's cache:
deliver's small passes (deltamq/jobs/deliver_files.py, at most as many messages) then
find the bodies decoded. Above it only the columns the index needs are read (no
bodies)."""
TIMER_SLOT_MS = 3_600_000
XXHASH_SEED = 42
"""Spark's ``xxhash64`` seed: ``tags_hash`` must equal what the engine writes."""
COLUMNS = TABLES["consume_queue"].columns
_READ = ("topic", "queue_id", "msg_id", "tags", "keys", "properties", "store_ts", "reconsume_times",
         "sys_flag", "batch_id", "batch_pos", "born_ts")  # fmt: skip
_PROPS = pa.map_(pa.string(), pa.string())

Queue = tuple[str, int]


class _Held:
    """The snapshots a pass read its state from, handed to ``file_reads`` without a second
    refresh: the plan and the version it is appended after come from one look."""

    def __init__(self, snaps: Mapping[str, FileSnapshot]) -> None:
        self.snaps = dict(snaps)

    def snapshot(self, table: str) -> FileSnapshot | None:
        return self.snaps.get(table)


@dataclass(frozen=True)
class FilesState:
    """Dispatch's state as the files say (``consume_queue.DispatchState``'s fields) and
    the ``consume_queue`` version it was read at: the index commit goes right after it."""

    index_version: int
    version: int
    heads: dict[Queue, int]
    stale: dict[Queue, int]
    held: _Held


def state(wh: Warehouse) -> FilesState | None:
    """Dispatch's hint corrected by the index rows newer than it, from one refresh of the
    ``offsets``, ``consume_queue`` and ``commit_log`` snapshots; None when a pass cannot be
    planned and appended here (the caller reads the state through the engine)."""
    if wh.arrow_appender("consume_queue") is None and not wh.engine.idempotent_appends:
        return None
    snaps = {t: wh.snapshot(t) for t in ("consume_queue", "offsets", "commit_log")}
    if any(s is None for s in snaps.values()):
        return None
    held = _Held({t: s for t, s in snaps.items() if s is not None})
    index_version = held.snaps["consume_queue"].version
    hint = file_reads.dispatch_hint(held)
    if hint is None:
        return None
    version, recorded = file_reads.hint_of(hint)
    newer = file_reads.heads_after(held, version)
    if newer is None:
        return None
    version, heads, stale = file_reads.corrected(version, recorded, newer)
    return FilesState(index_version, version, heads, stale, held)


def fits(commits: Sequence[deltalog.Commit]) -> bool:
    """Whether the commits' new rows can be indexed here: their count is known and at most
    :data:`MAX_ROWS` (:data:`MAX_ORDERED_ROWS` when every file says its rows are ordered by
    queue), and none may be a committed transactional message."""
    files = [f for c in commits for f in c.files]
    counts = [f.num_records for f in files]
    ordered = all((f.tags or {}).get(ORDERED_BY_TAG) == _BY_QUEUE for f in files)
    most = MAX_ORDERED_ROWS if ordered else MAX_ROWS
    if any(n is None for n in counts) or sum(n or 0 for n in counts) > most:
        return False
    return not commit_log.may_hold_commits(list(commits))


def added(wh: Warehouse, fs: FilesState, commits: Sequence[deltalog.Commit]) -> pa.Table:
    """The ``commit_log`` rows the commits added, each with its commit's ``cl_version``,
    decoded through the kept snapshot (its cache, for a pass deliver may take from the
    files next: :data:`KEEP_DECODED`). A
    missing or truncated file raises TableDamaged naming it, as the engine's read does."""
    snap = fs.held.snaps["commit_log"]
    keep = sum(f.num_records or 0 for c in commits for f in c.files) <= KEEP_DECODED
    parts = []
    for c in commits:
        for f in c.files:
            data = DataFile(f.path, dict(f.partition_values), f.min_values, f.max_values, f.num_records)
            try:
                part = snap.whole(data).select(list(_READ)) if keep else snap.columns(data, list(_READ))
            except Exception:
                check_added(wh.storage, "commit_log", [f])  # names the damaged file
                raise
            parts.append(part.append_column("cl_version", pa.array([c.version] * part.num_rows, pa.int64())))
    if not parts:
        empty = snap.read([], list(_READ))
        return empty.append_column("cl_version", pa.array([], pa.int64()))
    return pa.concat_tables(parts, promote_options="permissive")


def drop_repeated(fs: FilesState, rows: pa.Table, commits: Sequence[deltalog.Commit]) -> tuple[pa.Table, int]:
    """``consume_queue.drop_repeated`` on Arrow rows: without the messages already indexed
    (looked up in the index files of the new batch ids) or repeated by an earlier new row.
    Returns the rows and how many were dropped."""
    batches, exact = commit_log.batch_ids(list(commits))
    indexed: set[str] = set()
    if batches:
        lo, hi = min(batches), max(batches)
        snap = fs.held.snaps["consume_queue"]
        parts = [
            snap.columns(f, ["cl_batch_id", "msg_id"])
            for f in snap.files(lambda f: f.overlaps("cl_batch_id", lo, hi))
        ]  # two columns, not the whole files
        found = pa.concat_tables(parts) if parts else snap.read([], ["cl_batch_id", "msg_id"])
        found = found.filter((pc.field("cl_batch_id") >= lo) & (pc.field("cl_batch_id") <= hi))
        hit = pc.is_in(found.column("cl_batch_id"), value_set=pa.array(sorted(batches), pa.int64()))
        indexed = set(found.filter(hit).column("msg_id").to_pylist())
    if exact and not indexed:
        return rows, 0
    keep = np.ones(rows.num_rows, dtype=bool)
    if not exact:
        order = pc.sort_indices(rows, [("cl_version", "ascending"), ("batch_pos", "ascending")]).to_pylist()
        msg = rows.column("msg_id").to_pylist()
        seen: set[str] = set()
        for i in order:
            if msg[i] in seen:
                keep[i] = False
            seen.add(msg[i])
    if indexed:
        keep &= ~pc.is_in(rows.column("msg_id"), value_set=pa.array(sorted(indexed))).to_numpy(
            zero_copy_only=False
        )
    out = rows.filter(pa.array(keep))
    return out, rows.num_rows - out.num_rows


def _int_prop(props: pa.ChunkedArray, key: str, digits: int) -> pa.Array:
    """A property as an int64 when it is 1..``digits`` decimal digits, else null
    (``consume_queue.int_prop``)."""
    if all(pc.index(chunk.keys, key).as_py() < 0 for chunk in props.chunks):  # no row has it
        return pa.nulls(len(props), pa.int64())
    raw = pc.map_lookup(props, key, "first")
    ok = pc.fill_null(pc.match_substring_regex(raw, f"^[0-9]{{1,{digits}}}$"), False)
    return pc.cast(pc.if_else(ok, raw, pa.scalar(None, pa.string())), pa.int64())


def tags_hash(tags: pa.ChunkedArray) -> pa.Array:
    """Spark's ``xxhash64(tags)`` (seed 42, a signed 64-bit value), null for a null tag;
    each distinct tag hashed once."""
    distinct = pc.unique(tags).drop_null()
    values = [xxhash.xxh64_intdigest(t.encode("utf-8"), seed=XXHASH_SEED) for t in distinct.to_pylist()]
    signed = pa.array(np.array(values, dtype=np.uint64).view(np.int64), pa.int64())
    return pc.take(signed, pc.index_in(tags, value_set=distinct))


def _routes(rows: pa.Table, levels: list[tuple[int, int]]) -> dict[str, pa.Array]:
    """Each row's route flags (``half``, ``timer``, ``schedule``, ``plain``) and its delay
    ``level`` (clamped to the highest) and ``timer_ms`` (``consume_queue._routed``)."""
    props = rows.column("properties")
    max_level = max((lvl for lvl, _ in levels), default=0)
    half = pc.fill_null(
        pc.and_(
            pc.and_(
                pc.equal(pc.map_lookup(props, Prop.TRAN_MSG, "first"), "true"),
                pc.equal(pc.bit_wise_and(rows.column("sys_flag"), 0xC), SysFlag.TRANSACTION_PREPARED_TYPE),
            ),
            pc.not_equal(rows.column("topic"), TRANS_CHECK_MAX_TIME_TOPIC),
        ),
        False,
    )
    timer_ms = _int_prop(props, Prop.TIMER_DELIVER_MS, 18)
    level = pc.min_element_wise(_int_prop(props, Prop.DELAY, 9), max_level, skip_nulls=False)
    timer = pc.and_(pc.invert(half), pc.is_valid(timer_ms))
    schedule = pc.and_(
        pc.and_(pc.invert(half), pc.invert(timer)),
        pc.fill_null(pc.greater(level, 0), False) if max_level > 0 else pa.array([False] * rows.num_rows),
    )
    plain = pc.invert(pc.or_(pc.or_(half, timer), schedule))
    return {
        "half": half,
        "timer": timer,
        "schedule": schedule,
        "plain": plain,
        "level": level,
        "timer_ms": timer_ms,
    }


def _due(rows: pa.Table, r: dict[str, pa.Array], levels: list[tuple[int, int]]) -> pa.Array:
    """Each row's due time: a timer's deliver time, a delayed message's store time plus its
    level's delay, a copy promote wrote its store time (when it may be handed out)."""
    delays = dict(levels)
    delay = pc.take(
        pa.array([delays.get(lvl) for lvl in range(max(delays, default=0) + 1)], pa.int64()),
        pc.fill_null(r["level"], 0),
    )
    batch = rows.column("batch_id")
    kind = pc.bit_wise_and(batch, ids.PRODUCER_BIT - 1)
    copy = pc.and_(
        pc.equal(pc.bit_wise_and(batch, ids.PRODUCER_BIT), 0),
        pc.and_(pc.greater_equal(kind, 1), pc.less_equal(kind, ids.KIND_TIMER)),
    )
    store_ts = rows.column("store_ts")
    return pc.case_when(
        pc.make_struct(r["timer"], r["schedule"], pc.and_(r["plain"], copy)),
        r["timer_ms"],
        pc.add(store_ts, delay),
        store_ts,
        pa.scalar(None, pa.int64()),
    )


def plan(rows: pa.Table, heads: Mapping[Queue, int], levels: list[tuple[int, int]]) -> pa.Table:
    """``consume_queue.plan_index`` on Arrow rows (``commit_log`` columns with
    ``cl_version``): the index rows in the table's column order, plus ``route``."""
    topic, qid = rows.column("topic"), rows.column("queue_id")
    r = _routes(rows, levels)
    flags = pc.make_struct(r["half"], r["timer"], r["schedule"])
    q_id = pc.cast(
        pc.case_when(
            pc.make_struct(r["schedule"], pc.or_(r["half"], r["timer"])),
            pc.subtract(r["level"], 1),
            pa.scalar(0, pa.int64()),
            pc.cast(qid, pa.int64()),
        ),
        pa.int32(),
    )
    due = _due(rows, r, levels)
    slot = pc.case_when(
        pc.make_struct(r["schedule"], r["timer"]),
        pc.cast(q_id, pa.int64()),
        pc.divide(due, TIMER_SLOT_MS),  # due times are positive: division floors
        pa.scalar(0, pa.int64()),
    )
    out = {
        "topic": pc.case_when(flags, TRANS_HALF_TOPIC, TIMER_TOPIC, SCHEDULE_TOPIC, topic),
        "queue_id": q_id,
        "msg_id": rows.column("msg_id"),
        "tags": rows.column("tags"),
        "tags_hash": tags_hash(rows.column("tags")),
        "keys": rows.column("keys"),
        "properties": _routed_props(rows.column("properties"), r["plain"], topic, qid),
        "store_ts": rows.column("store_ts"),
        "due_ts": due,
        "reconsume_times": rows.column("reconsume_times"),
        "cl_date": pc.cast(pc.cast(pc.divide(rows.column("store_ts"), ids.DAY_MS), pa.int32()), pa.date32()),
        "cl_version": rows.column("cl_version"),
        "cl_batch_id": rows.column("batch_id"),
        "cl_batch_pos": rows.column("batch_pos"),
        "slot": pc.cast(slot, pa.int32()),
        "born_ts": rows.column("born_ts"),
        "route": pc.case_when(flags, "half", "timer", "schedule", pa.scalar("plain")),
    }
    return _with_offsets(pa.table(out), heads)


def _routed_props(
    props: pa.ChunkedArray, plain: pa.Array, topic: pa.ChunkedArray, qid: pa.ChunkedArray
) -> pa.Array:
    """Properties as the index keeps them: a plain row's as stored; a routed row's without
    any ``REAL_TOPIC`` / ``REAL_QID`` it had, then those two naming its real queue."""
    props = props.combine_chunks()
    if pc.all(plain).as_py():
        return props
    routed = np.flatnonzero(~pc.fill_null(plain, True).to_numpy(zero_copy_only=False))
    at = pa.array(routed, pa.int64())
    values = props.take(at).to_pylist()  # only the routed rows go through Python
    topics, qids = topic.take(at).to_pylist(), qid.take(at).to_pylist()
    drop = (Prop.REAL_TOPIC, Prop.REAL_QID)
    for i, value in enumerate(values):
        kept = [(k, v) for k, v in (value or []) if k not in drop]
        values[i] = [*kept, (Prop.REAL_TOPIC, topics[i]), (Prop.REAL_QID, str(qids[i]))]
    n = len(props)
    order = np.arange(n, dtype=np.int64)
    order[routed] = n + np.arange(len(routed), dtype=np.int64)  # each routed row from the rebuilt ones
    return pa.concat_arrays([props, pa.array(values, _PROPS)]).take(pa.array(order))


def _with_offsets(table: pa.Table, heads: Mapping[Queue, int]) -> pa.Table:
    """``table`` ordered by queue, then (commit version, batch, position), with each row's
    ``queue_offset``: its queue's head plus its rank in that order. Rows usually arrive
    in that order within each queue (a commit's files in batch order; a producer's file
    grouped by queue), so a stable sort by queue alone is tried first and kept when it
    gives that order; otherwise all five keys are sorted. A pass already in order is not
    copied."""
    n = table.num_rows
    at = table.column_names.index("msg_id")
    if n == 0:
        return table.add_column(at, "queue_offset", pa.array([], pa.int64()))
    topics = pc.dictionary_encode(table.column("topic"), null_encoding="encode").combine_chunks()
    names = topics.dictionary.to_pylist()
    rank = np.empty(len(names), dtype=np.int64)  # Arrow's order: UTF-8 bytes, nulls last
    rank[sorted(range(len(names)), key=lambda i: (names[i] is None, (names[i] or "").encode()))] = np.arange(
        len(names)
    )
    qid = table.column("queue_id").to_numpy().astype(np.int64) + (1 << 31)  # an int32, made non-negative
    queue = (rank[topics.indices.to_numpy()] << 32) + qid
    later = [
        table.column(c).to_numpy().astype(np.int64) for c in ("cl_version", "cl_batch_id", "cl_batch_pos")
    ]
    order = np.argsort(queue, kind="stable")
    if not _ascending([queue[order], *(k[order] for k in later)]):
        order = np.lexsort((*reversed(later), queue))
    if not np.array_equal(order, np.arange(n)):
        table, queue = table.take(pa.array(order)), queue[order]
    starts = np.concatenate([[0], np.flatnonzero(queue[1:] != queue[:-1]) + 1])
    lengths = np.diff(np.append(starts, n))
    firsts = table.select(["topic", "queue_id"]).take(pa.array(starts)).to_pylist()  # each run's queue
    base = np.array(
        [heads.get((r["topic"], r["queue_id"]), 0) - s for r, s in zip(firsts, starts, strict=True)],
        dtype=np.int64,
    )
    offsets = np.repeat(base, lengths) + np.arange(n, dtype=np.int64)
    return table.add_column(at, "queue_offset", pa.array(offsets, pa.int64()))


def _ascending(keys: Sequence[np.ndarray]) -> bool:
    """Whether rows are in non-decreasing order of ``keys`` (compared left to right)."""
    if len(keys[0]) < 2:
        return True
    undecided = np.ones(len(keys[0]) - 1, dtype=bool)
    for k in keys:
        if np.any(undecided & (k[1:] < k[:-1])):
            return False
        undecided &= k[1:] == k[:-1]
    return True


def tally(index: pa.Table) -> list[tuple[Queue, int, int]]:
    """(queue, rows, highest offset) of planned index rows, as ``consume_queue`` reads
    them back after the engine's ``MERGE``."""
    grouped = index.group_by(["topic", "queue_id"]).aggregate(
        [("queue_offset", "count"), ("queue_offset", "max")]
    )
    return [
        ((r["topic"], r["queue_id"]), r["queue_offset_count"], r["queue_offset_max"])
        for r in grouped.to_pylist()
    ]


INDEX_APP = "deltamq-index"
"""The application id of index appends the engine records (Apache Spark's idempotent
appends)."""


def append(wh: Warehouse, fs: FilesState, index: pa.Table) -> None:
    """The index commit: ``index`` appended to ``consume_queue`` as the version after the
    one ``fs`` was read at (a commit conflict when another writer has taken it). Where the
    engine must write (Apache Spark on a local disk) it is the engine's append, recorded as
    ``INDEX_APP`` at that next version: a value above any recorded before (each was at
    most its own commit's version, and the table has not gone back), so a legitimate
    append is never skipped, even after the index was emptied (``rebuild-index``); two
    indexers racing from one read (a lease violation) conflict. A retry after a failed
    attempt plans again from the table as it is, where rows that landed are indexed."""
    rows = index.select(list(COLUMNS))
    appender = wh.arrow_appender("consume_queue")
    if appender is not None:
        appender.append(rows, at=fs.index_version + 1)
        return
    if not wh.engine.idempotent_appends:  # state() said so; only a protocol change withdraws it
        raise Unsupported(f"{wh.uri('consume_queue')} can no longer be appended to without the engine")
    frame = wh.engine.spark.createDataFrame(rows, TABLES["consume_queue"].columns_at(SCHEMA_VERSION))
    wh.append("consume_queue", frame, once=(INDEX_APP, fs.index_version + 1))
