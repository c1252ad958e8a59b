"""Index ranges, message bodies and small control tables read from the tables' files,
without the engine.

A pull client reads a few thousand ``consume_queue`` rows and their ``commit_log``
bodies per call. Through the engine that is two statements (tens of milliseconds
each on Sail, more on Spark); here it is the files those rows are in, picked from a
kept snapshot of each table (deltamq/delta_read.py) by partition values and the
offset or batch-id statistics, and read with pyarrow. Each function returns None when
a table must be read with the engine instead (its protocol asks for more than plain
Parquet files). Spark-free: the broker's warehouse and the Spark-free pull client
(deltamq/pull_files.py) both hand it their snapshots.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deltamq import body_reads, ids
from deltamq.body_reads import FILE, ROW, BodyFiles
from deltamq.config import Subscription
from deltamq.constants import DISPATCH_GROUP, SCHEDULE_TOPIC, TIMER_TOPIC
from deltamq.delta_append import GROUPED_FROM
from deltamq.delta_read import DataFile, FileSnapshot, picked, positions
from deltamq.filters import parse_tag_expression
from deltamq.pull_log import LOG_COLUMNS, LogRow

P = TypeVar("P")

HELD_TOPICS = (SCHEDULE_TOPIC, TIMER_TOPIC)
"""The index topics whose rows wait for their due time in promote's care: every other
row with a ``due_ts`` is a copy promoted ahead, not visible before it."""


class Snapshots(Protocol):
    """Where the tables' snapshots come from (``Warehouse.snapshot``, the pull client's)."""

    def snapshot(self, table: str) -> FileSnapshot | None: ...


Range = tuple[str, int, int, int]  # topic, queue, first offset, end offset (exclusive)


def rows(
    wh: Snapshots,
    table: str,
    columns: Sequence[str],
    where: pc.Expression | None = None,
    keep: Callable[[DataFile], bool] | None = None,
) -> pa.Table | None:
    """Rows of a table matching ``where``, ``columns`` only, read from its files (those
    ``keep`` accepts, by partition values and statistics; all by default)."""
    snap = wh.snapshot(table)
    if snap is None:
        return None
    return snap.read(snap.files(keep) if keep else snap.files(), list(columns), where)


def holds(wh: Snapshots, table: str, column: str, value: Any) -> bool | None:
    """Whether a row of ``table`` has ``column`` = ``value`` (the files its statistics
    allow read, that column only)."""
    keep: Callable[[DataFile], bool] = lambda f: f.overlaps(column, value, value)  # noqa: E731
    found = rows(wh, table, [column], pc.field(column) == value, keep)
    return None if found is None else found.num_rows > 0


def all_rows(wh: Snapshots, table: str, columns: Sequence[str] | None = None) -> list[dict[str, Any]] | None:
    """Every row of a small table (``columns`` only; all by default) as dicts, from its
    kept snapshot: the control tables a tick reads (group and subscription settings,
    offsets, delay levels) cost a look at the next log entry instead of a statement."""
    snap = wh.snapshot(table)
    if snap is None:
        return None
    return snap.read(snap.files(), list(columns) if columns else snap.column_names).to_pylist()


def index_rows(wh: Snapshots, ranges: Sequence[Range], columns: Sequence[str]) -> pa.Table | None:
    """``consume_queue`` rows within ``ranges``, ``columns`` only, in no set order (a
    row within two ranges once)."""
    merged: list[list[Any]] = []
    for topic, q, lo, hi in sorted(ranges):  # overlapping ranges of a queue as one
        if merged and merged[-1][:2] == [topic, q] and lo <= merged[-1][3]:
            merged[-1][3] = max(merged[-1][3], hi)
        else:
            merged.append([topic, q, lo, hi])
    found = index_by_range(wh, [(t, q, lo, hi) for t, q, lo, hi in merged], columns)
    if found is None:
        return None
    return pa.concat_tables(found) if found else _empty(wh, columns)


def index_by_range(wh: Snapshots, ranges: Sequence[Range], columns: Sequence[str]) -> list[pa.Table] | None:
    """``consume_queue`` rows of each of ``ranges`` ((topic, queue, first offset, end)),
    ``columns`` only: one table per range, in the order given (a row within two ranges
    is in both); None when the table must be read with the engine."""
    snap = wh.snapshot("consume_queue")
    if snap is None:
        return None
    out: list[list[pa.Table]] = [[] for _ in ranges]
    by_topic: dict[str, list[int]] = defaultdict(list)
    for k, (topic, _, _, _) in enumerate(ranges):
        by_topic[topic].append(k)

    def within(f: DataFile, k: int) -> bool:
        _, q, lo, hi = ranges[k]
        return f.overlaps("queue_id", q, q) and f.overlaps("queue_offset", lo, hi - 1)

    for f in snap.files(
        lambda f: any(within(f, k) for k in by_topic.get(f.partition.get("topic") or "", ()))
    ):
        mine = [k for k in by_topic.get(f.partition.get("topic") or "", ()) if within(f, k)]
        keyed = snap.sorted_keys(f, "queue", _queue_keys, ["queue_id", "queue_offset"])
        if keyed is None:
            for k in mine:
                t, q, lo, hi = ranges[k]
                where = (
                    (pc.field("topic") == t)
                    & (pc.field("queue_id") == q)
                    & _between("queue_offset", lo, hi - 1)
                )
                out[k].append(snap.read([f], list(columns), where))
            continue
        top = 1 << QUEUE_SHIFT  # a range's end past the key's offsets would reach the next queue
        found = [
            keyed.rows_between((q << QUEUE_SHIFT) + min(lo, top), (q << QUEUE_SHIFT) + min(hi, top))
            for _, q, lo, hi in (ranges[k] for k in mine)
        ]
        # one read of the file for all its ranges, then each range's rows sliced from it
        rows = snap.taken(f, np.concatenate(found), list(columns))
        at = 0
        for k, r in zip(mine, found, strict=True):
            out[k].append(rows.slice(at, len(r)))
            at += len(r)
    return [pa.concat_tables(parts) if parts else _empty(wh, columns) for parts in out]


def _empty(wh: Snapshots, columns: Sequence[str]) -> pa.Table:
    snap = wh.snapshot("consume_queue")
    assert snap is not None
    return snap.read([], list(columns))


QUEUE_SHIFT = 40
"""Bits of a queue offset in the key :func:`index_rows` orders a file's rows by (queue id
above them): offsets up to 2^40 (a trillion) per queue."""


def _queue_keys(data: pa.Table) -> np.ndarray | None:
    """Each row's (queue id, offset) as one int64, or None when a file's values do not fit
    (the reader filters it instead)."""
    qid, off = data.column("queue_id"), data.column("queue_offset")
    if not data.num_rows:
        return np.zeros(0, np.int64)
    if qid.null_count or off.null_count:
        return None
    q, o = qid.to_numpy().astype(np.int64), off.to_numpy()
    if q.min() < 0 or q.max() >= 1 << (62 - QUEUE_SHIFT) or o.min() < 0 or o.max() >= 1 << QUEUE_SHIFT:
        return None
    return (q << QUEUE_SHIFT) + o


def bodies(wh: Snapshots, index: pa.Table, columns: Sequence[str]) -> pa.Table | None:
    """``index`` (consume_queue rows: ``cl_date``, ``cl_batch_id``, ``cl_batch_pos``,
    ``msg_id``) with the ``columns`` of each row's ``commit_log`` row; rows whose body is
    gone (retention) are left out, as by the engine jobs' join."""
    snap = wh.snapshot("commit_log")
    if snap is None:
        return None
    if index.num_rows == 0:
        return _with(index, snap.read([], list(columns)))
    chosen, where, _ = _body_files(snap, index)
    ids, pos = index.column("cl_batch_id").to_numpy(), index.column("cl_batch_pos").to_numpy()
    found = [_located(snap, f, ids, pos) for f in chosen]
    located = [places for places in found if places is not None]
    if chosen and len(located) == len(found):
        return _placed(index, snap, chosen, located, columns)
    picks = [None if places is None else np.unique(places[1][places[0]]) for places in found]
    return join_bodies(index, [snap.whole(f) for f in chosen], columns, where, picks)


def _body_files(snap: FileSnapshot, index: pa.Table) -> tuple[list[DataFile], pc.Expression, set[int]]:
    """The ``commit_log`` files that may hold the rows of ``index`` (not empty), picked by
    date, batch id and position statistics; the filter of their rows to those ranges; and
    the batch ids ``index`` wants."""
    wanted = pc.unique(index.column("cl_batch_id")).to_pylist()
    dates = {d.isoformat() for d in index.column("cl_date").unique().to_pylist()}
    batches = merge_ranges(wanted)
    span = pc.min_max(index.column("cl_batch_pos"))
    low, high = span["min"].as_py(), span["max"].as_py()

    def keep(f: DataFile) -> bool:
        # positions too: an engine's write of one large send spreads one batch over many
        # files, told apart only by their batch_pos statistics
        if f.partition.get("store_date") not in dates or not f.overlaps("batch_pos", low, high):
            return False
        return any(f.overlaps("batch_id", lo, hi) for lo, hi in batches)

    where = _any(_between("batch_id", lo, hi) for lo, hi in batches) & _between("batch_pos", low, high)
    return snap.files(keep), where, set(wanted)


LOCATED_GROUP_ROWS = 65_536
"""Rows a row group of a file :func:`located` hands to listener workers may hold (the
producers write groups of 8 192, ``delta_append.GROUP_ROWS``)."""


def located(
    wh: Snapshots, index: pa.Table, columns: Sequence[str], by_place: bool = False
) -> tuple[pa.Table, BodyFiles] | None:
    """``index`` (consume_queue rows, as for :func:`bodies`) with where each row's
    ``commit_log`` row lies instead of its ``columns``: ``body_reads.FILE`` (an index
    into the returned files' paths) and ``body_reads.ROW``, for a listener worker to read
    them itself. Rows whose body is gone are left out, and of a message stored twice the
    first file's row is taken, as :func:`bodies` does; nothing of the files but their
    positions is read here (the worker checks the row's ``msg_id`` is the index row's:
    ``body_reads``). None unless the warehouse is local and every file holding wanted
    rows holds one batch (its rows found by position) of at least
    ``delta_append.GROUPED_FROM`` rows, in row groups of at most
    :data:`LOCATED_GROUP_ROWS` unless ``by_place``: the rows go to the workers by where
    they lie (``deliver_files.by_place``), so a worker decodes a large group once, not
    once per queue."""
    snap = wh.snapshot("commit_log")
    if snap is None or not snap.storage.is_local or index.num_rows == 0:
        return None
    ids, pos = index.column("cl_batch_id").to_numpy(), index.column("cl_batch_pos").to_numpy()
    candidates, _, wanted = _body_files(snap, index)
    # files of one batch not taken here (another send within the batch-id ranges) are not
    # the pass's: they neither hold its rows nor decide its way
    chosen = [f for f in candidates if _batch_of(f) is None or _batch_of(f) in wanted]
    # a worker decodes whole row groups: an engine's file of one group of half a million
    # rows would be decoded by every worker that has one of its queues, and so would a
    # small producer file (under GROUPED_FROM rows its queues are not in groups of their
    # own) by each worker, for each of its queues
    if any((f.num_records or 0) < GROUPED_FROM for f in chosen):
        return None
    if not by_place and any((snap.largest_group(f) or 0) > LOCATED_GROUP_ROWS for f in chosen):
        return None
    found = [_located(snap, f, ids, pos, narrow=True) for f in chosen]  # only their positions read
    if any(places is None for places in found):
        return None
    file_of = np.full(index.num_rows, -1, dtype=np.int32)
    row_of = np.zeros(index.num_rows, dtype=np.int64)
    for k, places in enumerate(found):
        assert places is not None  # every file was located (above)
        hit, rows = places
        at = np.flatnonzero(hit & (file_of < 0))
        file_of[at], row_of[at] = k, rows[at]
    kept = np.flatnonzero(file_of >= 0)
    out = picked(index, kept)
    out = out.append_column(FILE, pa.array(file_of[kept], pa.int32()))
    out = out.append_column(ROW, pa.array(row_of[kept], pa.int64()))
    schema = snap.read([], [*dict.fromkeys([*columns, "msg_id"])]).schema
    return out, BodyFiles(
        snap.storage.location,
        tuple(f.path for f in chosen),
        schema,
        body_reads.STREAM_FROM if by_place else None,
    )


def _batch_of(f: DataFile) -> int | None:
    """The one batch id a file holds, per its statistics (None: several, or unknown)."""
    lo = f.min_values.get("batch_id")
    return int(lo) if lo is not None and lo == f.max_values.get("batch_id") else None


def _positions(data: pa.Table) -> np.ndarray | None:
    column = data.column("batch_pos")
    return None if column.null_count else column.to_numpy()


def _located(
    snap: FileSnapshot, f: DataFile, ids: np.ndarray, pos: np.ndarray, narrow: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Where file ``f`` holds each index row's (batch id, position): a mask over the
    index rows and, where it is set, the file's row, found by binary search over its
    positions when it holds one batch (a large send spreads one batch over few large
    files: a filter over every row cost a pull most of its read); None to filter the
    file instead."""
    batch = _batch_of(f)
    if batch is None:
        return None
    keyed = snap.sorted_keys(f, "batch_pos", _positions, ["batch_pos"], narrow)
    if keyed is None:
        return None
    mine = np.nonzero(ids == batch)[0]
    hit, rows = np.zeros(len(ids), dtype=bool), np.zeros(len(ids), dtype=np.int64)
    hit[mine], rows[mine] = keyed.rows_equal(pos[mine])
    return hit, rows


def _placed(
    index: pa.Table,
    snap: FileSnapshot,
    files: Sequence[DataFile],
    found: Sequence[tuple[np.ndarray, np.ndarray]],
    columns: Sequence[str],
) -> pa.Table:
    """:func:`join_bodies` where every file's rows were located (:func:`_located`): each
    index row takes the ``columns`` of the first file row at its place whose ``msg_id``
    is the index row's too (as the join keeps the first of twice-stored rows); index
    rows without one are left out. No join: the rows are taken where they are
    (``FileSnapshot.taken``: of a file in row groups, only the groups holding them)."""
    wanted = index.column("msg_id")
    done = np.zeros(index.num_rows, dtype=bool)
    names = [*dict.fromkeys([*columns, "msg_id"])]
    out = []
    for f, (hit, rows) in zip(files, found, strict=True):
        at = np.nonzero(hit & ~done)[0]
        if len(at) == 0:
            continue
        stored = snap.taken(f, rows[at], names)
        same = (
            pc.equal(stored.column("msg_id"), wanted.take(at)).fill_null(False).to_numpy(zero_copy_only=False)
        )
        if not same.all():
            at, stored = at[same], stored.filter(same)
        done[at] = True
        out.append(_with(picked(index, at), stored.select(list(columns))))
    if not out:
        return _with(index.slice(0, 0), snap.read([], list(columns)))
    return pa.concat_tables(out)


_JOIN_KEYS = ("batch_id", "batch_pos", "msg_id")


def join_bodies(
    index: pa.Table,
    parts: Sequence[pa.Table],
    columns: Sequence[str],
    where: pc.Expression | None = None,
    picks: Sequence[np.ndarray | None] | None = None,
) -> pa.Table:
    """``index`` with the ``columns`` of its rows' ``commit_log`` rows, found in ``parts``
    (tables of ``batch_id``, ``batch_pos``, ``msg_id`` and those columns; ``where``
    narrows them first, or, for a part with one, its ``picks`` entry: the rows to look
    at), joined in Arrow on (batch id, position, msg id), in no set order. Rows without a
    body are left out. Each part's wide columns are copied once, at the matching rows
    only."""
    keys = ["cl_batch_id", "cl_batch_pos", "msg_id"]
    found = []
    for k, part in enumerate(parts):
        pick = picks[k] if picks is not None else None
        rows = positions(part.num_rows) if pick is None else pa.array(pick, pa.int64())
        narrow = pa.table(
            {
                **{c: part.column(c) if pick is None else part.column(c).take(rows) for c in _JOIN_KEYS},
                "_j": rows,
            }
        )
        narrow = narrow if where is None or pick is not None else narrow.filter(where)
        found.append(narrow.append_column("_f", pa.array([k] * narrow.num_rows, pa.int32())))
    left = index.select(keys).append_column("_i", positions(index.num_rows))
    right = _first_of_each(pa.concat_tables(found)) if found else None
    out = []
    if right is not None and right.num_rows:
        pairs = left.join(right, keys, right_keys=["batch_id", "batch_pos", "msg_id"], join_type="inner")
        for k, part in enumerate(parts):
            mine = pairs.filter(pc.field("_f") == k)
            if mine.num_rows:
                out.append(
                    _with(index.take(mine.column("_i")), part.select(list(columns)).take(mine.column("_j")))
                )
    if not out:
        empty = parts[0].select(list(columns)).slice(0, 0) if parts else None
        return _with(index.slice(0, 0), empty) if empty is not None else index.slice(0, 0)
    return pa.concat_tables(out)


def _first_of_each(found: pa.Table) -> pa.Table:
    """One row per (batch id, position, msg id): ``commit_log`` can hold a message twice
    with the same ids (an ambiguous commit written again; the index keeps one entry), and
    a join with both would hand it out twice."""
    if found.num_rows < 2:
        return found
    code = pc.add(pc.multiply(pc.cast(found.column("_f"), pa.int64()), 1 << 32), found.column("_j"))
    keys = ["batch_id", "batch_pos", "msg_id"]
    first = found.select(keys).append_column("_c", code).group_by(keys).aggregate([("_c", "min")])
    if first.num_rows == found.num_rows:
        return found
    codes = first.column("_c_min")
    return pa.table(
        {
            **{k: first.column(k) for k in keys},
            "_j": pc.bit_wise_and(codes, (1 << 32) - 1),
            "_f": pc.cast(pc.shift_right(codes, 32), pa.int32()),
        }
    )


def _with(rows: pa.Table, more: pa.Table) -> pa.Table:
    for name in more.column_names:
        rows = rows.append_column(more.schema.field(name), more.column(name))
    return rows


HANDOUT_INDEX_COLUMNS = (
    "topic",
    "queue_id",
    "queue_offset",
    "msg_id",
    "tags",
    "keys",
    "store_ts",
    "reconsume_times",
    "cl_date",
    "cl_batch_id",
    "cl_batch_pos",
)
"""The ``consume_queue`` columns a pulled message is built from."""
HANDOUT_BODY_COLUMNS = ("body", "born_ts", "flag", "sys_flag", "properties")
"""The ``commit_log`` columns a pulled message is built from."""


def handout_rows(
    wh: Snapshots,
    subs: Sequence[Subscription],
    ranges: Sequence[Range],
    index_columns: Sequence[str] = HANDOUT_INDEX_COLUMNS,
    body_columns: Sequence[str] = HANDOUT_BODY_COLUMNS,
) -> pa.Table | None:
    """The ``consume_queue`` rows of ``ranges`` matching the tag subscriptions ``subs``
    (a topic without one: every row), with the ``body_columns`` of their ``commit_log``
    rows, in no set order; those whose body is gone are left out. SQL92 subscriptions are
    the engine's."""
    index = index_rows(wh, ranges, index_columns)
    if index is None:
        return None
    tags = {s.topic: parse_tag_expression(s.expression) for s in subs}  # None: every tag
    if any(listed is not None for listed in tags.values()):
        pairs = zip(index.column("topic").to_pylist(), index.column("tags").to_pylist(), strict=True)
        index = index.filter(
            [
                listed is None or (tag is not None and tag in listed)
                for topic, tag in pairs
                for listed in (tags.get(topic),)
            ]
        )
    return bodies(wh, index, body_columns)


def _between(column: str, lo: int, hi: int) -> pc.Expression:
    return (pc.field(column) >= lo) & (pc.field(column) <= hi)


def _any(preds: Iterable[pc.Expression]) -> pc.Expression:
    return balanced_or(preds, pc.scalar(False))


def balanced_or(preds: Iterable[P], none: P) -> P:
    """OR of ``preds`` as a balanced tree; ``none`` for no predicate. A left-deep chain of
    a few hundred ORs exceeds the nesting depth Spark Connect's protobuf decoder accepts."""
    items = list(preds)
    if not items:
        return none
    while len(items) > 1:
        items = [items[i] | items[i + 1] if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]  # type: ignore[operator]
    return items[0]


def merge_ranges(
    values: list[int], gap: int = 60_000 << ids.BATCH_RANDOM_BITS, most: int = 64
) -> list[tuple[int, int]]:
    """Sorted distinct values → at most ``most`` closed ranges; neighbours closer than
    ``gap`` share a range. A predicate over these ranges lets file statistics prune."""
    points = sorted(set(values))
    if not points:
        return []
    ranges = [[points[0], points[0]]]
    for v in points[1:]:
        if v - ranges[-1][1] <= gap:
            ranges[-1][1] = v
        else:
            ranges.append([v, v])
    while len(ranges) > most:  # merge across the smallest gap
        i = min(range(len(ranges) - 1), key=lambda k: ranges[k + 1][0] - ranges[k][1])
        ranges[i][1] = ranges[i + 1][1]
        del ranges[i + 1]
    return [(lo, hi) for lo, hi in ranges]


# --- the queue heads ------------------------------------------------------------------------
Queue = tuple[str, int]


def dispatch_hint(wh: Snapshots) -> list[dict] | None:
    """Dispatch's hint rows (``offsets`` of ``%DISPATCH%``): topic, queue_id, next_offset,
    progress_version (:func:`hint_of` reads them)."""
    found = rows(
        wh,
        "offsets",
        ["topic", "queue_id", "next_offset", "progress_version"],
        pc.field("consumer_group") == DISPATCH_GROUP,
    )
    return None if found is None else found.to_pylist()


def hint_of(hint: Iterable[Any]) -> tuple[int, dict[Queue, int]]:
    """The commit_log version dispatch recorded as indexed (-1: none) and the next offset
    it recorded per queue, from its hint rows (files or engine rows alike)."""
    version, heads = -1, {}
    for r in hint:
        if r["queue_id"] == -1:
            version = max(version, r["progress_version"] if r["progress_version"] is not None else -1)
        else:
            heads[(r["topic"], r["queue_id"])] = r["next_offset"]
    return version, heads


def corrected(
    version: int, heads: dict[Queue, int], newer: Iterable[Any]
) -> tuple[int, dict[Queue, int], dict[Queue, int]]:
    """The hint (``version``, ``heads``) corrected by ``newer``, the per-queue maxima of the
    index rows added after it (:func:`heads_after`): the version reached, every queue's
    head, and the heads the correction moved."""
    heads, stale = dict(heads), {}
    for r in newer:
        key = (r["topic"], r["queue_id"])
        heads[key] = stale[key] = max(heads.get(key, 0), r["next_offset"])
        version = max(version, r["v"])
    return version, heads, stale


def heads_after(wh: Snapshots, version: int) -> list[dict] | None:
    """Per queue with index rows from commit_log versions after ``version``: its next
    offset and the latest such version (``next_offset``, ``v``), from the files whose
    statistics say they hold such rows."""
    found = rows(
        wh,
        "consume_queue",
        ["topic", "queue_id", "queue_offset", "cl_version"],
        pc.field("cl_version") > version,
        keep=lambda f: f.overlaps("cl_version", version + 1, 1 << 62),
    )
    if found is None:
        return None
    grouped = found.group_by(["topic", "queue_id"]).aggregate(
        [("queue_offset", "max"), ("cl_version", "max")]
    )
    return [
        {
            "topic": r["topic"],
            "queue_id": r["queue_id"],
            "next_offset": r["queue_offset_max"] + 1,
            "v": r["cl_version_max"],
        }
        for r in grouped.to_pylist()
    ]


def heads(wh: Snapshots) -> dict[Queue, int] | None:
    """Every queue's next offset: dispatch's hint corrected by the index rows newer than
    it (``consume_queue.load_dispatch_state`` does the same with an engine fallback)."""
    hint = dispatch_hint(wh)
    if hint is None:
        return None
    version, recorded = hint_of(hint)
    newer = heads_after(wh, version)
    return None if newer is None else corrected(version, recorded, newer)[1]


def ahead_rows(wh: Snapshots, now: int) -> pa.Table | None:
    """``consume_queue`` rows of consumers' topics not due at ``now`` (copies promoted
    ahead): topic, queue_id, queue_offset, due_ts; read from the few files whose partition
    and ``due_ts`` statistics allow such rows."""

    def keep(f: DataFile) -> bool:
        if f.partition.get("topic") in HELD_TOPICS or f.all_null("due_ts"):
            return False
        return f.overlaps("due_ts", now + 1, 1 << 62)

    return rows(
        wh,
        "consume_queue",
        ["topic", "queue_id", "queue_offset", "due_ts"],
        (pc.field("due_ts") > now) & ~pc.field("topic").isin(list(HELD_TOPICS)),
        keep=keep,
    )


def not_due(wh: Snapshots, now: int) -> dict[Queue, tuple[int, int]] | None:
    """Per queue holding copies promoted ahead not due at ``now``: the first such offset
    and the earliest such due time (:func:`ahead_rows`)."""
    found = ahead_rows(wh, now)
    if found is None:
        return None
    grouped = found.group_by(["topic", "queue_id"]).aggregate([("queue_offset", "min"), ("due_ts", "min")])
    return {
        (r["topic"], r["queue_id"]): (r["queue_offset_min"], r["due_ts_min"]) for r in grouped.to_pylist()
    }


def clamped(heads: Mapping[Queue, int], not_due: Mapping[Queue, tuple[int, int]]) -> dict[Queue, int]:
    """``heads`` with each queue cut at its first row not yet due (``not_due``, as
    :func:`not_due` gives it), when there is one."""
    return {q: min(h, not_due[q][0]) if q in not_due else h for q, h in heads.items()}


# --- the deliveries log ---------------------------------------------------------------------
MAX_LOG_ROWS = 5_000
"""Rows of the deliveries log above which the tick's summary of it is the engine's
statement (10-20 ms on Sail): here each row becomes a Python tuple and is classed in
Python, 55 ms for 10 000 rows (measured on 2 cores)."""


def log_table(
    wh: Snapshots,
    where: pc.Expression | None = None,
    most: int | None = None,
    queues: Iterable[Queue] | None = None,
) -> pa.Table | None:
    """The deliveries log's rows matching ``where`` (its columns, :data:`LOG_COLUMNS`);
    None when the table must be read with the engine, or holds more than ``most`` rows.
    ``queues``: ``where`` takes rows of these queues only, so files whose statistics hold
    none of them are not read (a pull's append holds the queues it took from)."""
    snap = wh.snapshot("deliveries")
    if snap is None:
        return None
    wanted = None if queues is None else sorted(set(queues))

    def of_queues(f: DataFile) -> bool:
        return wanted is None or any(
            f.overlaps("topic", t, t) and f.overlaps("queue_id", q, q) for t, q in wanted
        )

    files = snap.files(of_queues)
    if most is not None and sum(most + 1 if f.num_records is None else f.num_records for f in files) > most:
        return None
    return snap.read(files, list(LOG_COLUMNS), where)


def log_rows(
    wh: Snapshots,
    where: pc.Expression | None = None,
    most: int | None = None,
    queues: Iterable[Queue] | None = None,
) -> list[LogRow] | None:
    """:func:`log_table`'s rows as tuples in the table's column order."""
    table = log_table(wh, where, most, queues)
    if table is None:
        return None
    return list(zip(*(table.column(c).to_pylist() for c in LOG_COLUMNS), strict=True))


def queues_filter(queues: Iterable[Queue]) -> pc.Expression:
    """Rows of any of ``queues`` (topic, queue_id)."""
    return balanced_or(
        ((pc.field("topic") == t) & (pc.field("queue_id") == q) for t, q in sorted(set(queues))),
        pc.scalar(False),
    )
