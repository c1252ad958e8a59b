"""Promote's reads and its copies built from the tables' files, without the engine.

A busy pass of promote used to spend three engine statements before its index commit:
the due entries and their summary, the look-up of copies already stored, and the
append of the copies with their bodies joined (about 170 ms of a 0.5 s tick on Sail,
under 10 000 timers a minute). Here the same three come from the kept snapshots of
``consume_queue`` and ``commit_log`` (deltamq/delta_read.py): the due entries are the
rows of the few files whose partition (the level's queue, the timer hour) and offset or
due-time statistics allow them, the already-stored ids and the bodies are read from the
``commit_log`` files of the entries' batch ranges, and the copies are built as an Arrow
table and appended as producers append (``Warehouse.append_arrow``).

Two ways, one result: every function computes what ``deltamq/jobs/promote.py`` computes
through the engine (same predicates, the same consecutive run per level, the same ids,
properties and store times; ``tests/test_promote_files.py`` compares them) and returns
None whenever it cannot be sure to (a table the file reader cannot read, a real queue
id that is not a plain number); the caller then takes the engine's way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import date
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from deltamq import file_reads, ids
from deltamq.constants import CLOCK_CORRECTION_SLACK_MS, SCHEDULE_TOPIC, TIMER_TOPIC, TRANS_HALF_TOPIC, Prop
from deltamq.delta_read import DataFile
from deltamq.sending import COMMIT_LOG_ARROW
from deltamq.tables.bodies import batch_spans, store_days
from deltamq.tables.consume_queue import TIMER_SLOT_MS

if TYPE_CHECKING:
    from deltamq.file_reads import Snapshots

CANDIDATE_COLUMNS = (
    "topic",
    "queue_id",
    "queue_offset",
    "msg_id",
    "properties",
    "due_ts",
    "cl_date",
    "cl_batch_id",
    "cl_batch_pos",
)
RESTORED = (
    "tags",
    "keys",
    "body",
    "flag",
    "properties",
    "born_ts",
    "reconsume_times",
    "sys_flag",
    "producer_group",
)
"""The ``commit_log`` columns a copy takes from its source message (``properties`` less
the schedule's own keys)."""
REMOVED_PROPS = (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.TIMER_DELIVER_MS)
SUMMARY_KEYS = (
    "topic",
    "queue_id",
    "skip",
    "real_topic",
    "real_qid",
    "cl_batch_id",
    "cl_date",
    "due_ts",
    "store_at",
)
"""What promote's summary groups the due entries by (through the engine or here)."""
MAX_ENTRIES = 20_000
"""Candidates above which a pass is the engine's: entries here cost a few microseconds
of Python each, the engine's statements a fixed ~50 ms each whatever their size, so a
backlog falling due at once (a restart after an outage, a bulk of timers) goes there."""
_FAR = 1 << 62


def corrected_after(now: int, delay_ms: int) -> int:
    """The due time after which a level's entry is clock-corrected at ``now``: ``now``
    plus the level's delay plus :data:`CLOCK_CORRECTION_SLACK_MS`."""
    return now + delay_ms + CLOCK_CORRECTION_SLACK_MS


def due_entries(
    wh: Snapshots,
    level_offsets: dict[int, int],
    timer_watermark: int,
    timer_next_offset: int,
    levels: Sequence[tuple[int, int]],
    now: int,
    until: int,
) -> tuple[list[dict[str, Any]], int | None] | None:
    """The entries a pass at ``now`` promotes (due by ``until``): for each level the run of
    consecutive offsets from its saved one whose entries are due by ``until`` or
    clock-corrected, and the timers due in (watermark, until] or indexed late. Each as a
    dict of :data:`CANDIDATE_COLUMNS` plus ``kind``, ``skip`` and ``store_at`` (as
    ``promote.plan_due`` and ``promote.store_at`` give them); and the timer queue's
    highest offset at or after ``timer_next_offset`` (None: no such entry). None when
    the files cannot be read, or hold more than :data:`MAX_ENTRIES` candidates (or their
    files four times as many rows)."""
    delays = {lvl - 1: ms for lvl, ms in levels}
    wm = timer_watermark
    hours = (max(wm, 0) // TIMER_SLOT_MS, until // TIMER_SLOT_MS)

    def keep(f: DataFile) -> bool:
        topic, slot = f.partition.get("topic"), f.partition.get("slot")
        if topic == SCHEDULE_TOPIC and slot is not None:
            q = int(slot)
            if q not in delays or not f.overlaps("queue_offset", level_offsets.get(q, 0), _FAR):
                return False
            # a level's pending entries span its whole delay: only files with one due by
            # ``until`` or clock-corrected are read (as the engine's statistics skip them)
            return f.overlaps("due_ts", -_FAR, until) or f.overlaps(
                "due_ts", corrected_after(now, delays[q]) + 1, _FAR
            )
        if topic == TIMER_TOPIC and slot is not None:
            in_window = hours[0] <= int(slot) <= hours[1] and f.overlaps("due_ts", wm + 1, until)
            return in_window or f.overlaps("queue_offset", timer_next_offset, _FAR)
        return False

    level_preds = [
        (pc.field("slot") == q)
        & (pc.field("queue_offset") >= level_offsets.get(q, 0))
        & ((pc.field("due_ts") <= until) | (pc.field("due_ts") > corrected_after(now, delay_ms)))
        for q, delay_ms in delays.items()
    ]
    window = (
        (pc.field("slot") >= hours[0])
        & (pc.field("slot") <= hours[1])
        & (pc.field("due_ts") > wm)
        & (pc.field("due_ts") <= until)
    )
    late = (pc.field("queue_offset") >= timer_next_offset) & (pc.field("due_ts") <= wm)
    timer_rows = pc.field("topic") == TIMER_TOPIC
    where = (
        (pc.field("topic") == SCHEDULE_TOPIC) & file_reads.balanced_or(level_preds, pc.scalar(False))
    ) | (timer_rows & (window | late))
    # Both reads from one refresh of the snapshot, the timer queue's last offset first: an
    # entry indexed between them would be left behind by the progress (the timer offset
    # moved past it, the watermark too) if the entries were read before it; read after
    # it, such an entry is promoted now or found again (its copy already stored).
    snap = wh.snapshot("consume_queue")
    if snap is None:
        return None

    def timer_tail(f: DataFile) -> bool:
        return f.partition.get("topic") == TIMER_TOPIC and f.overlaps("queue_offset", timer_next_offset, _FAR)

    newest = snap.read(
        snap.files(timer_tail), ["queue_offset"], timer_rows & (pc.field("queue_offset") >= timer_next_offset)
    )
    chosen = snap.files(keep)
    if sum(f.num_records or MAX_ENTRIES + 1 for f in chosen) > 4 * MAX_ENTRIES:
        return None  # a backlog: not decoded here
    found = snap.read(chosen, [*CANDIDATE_COLUMNS, "slot"], where)
    if found.num_rows > MAX_ENTRIES:
        return None
    timer_hi = pc.max(newest.column("queue_offset")).as_py() if newest.num_rows else None
    return _plan(found.drop_columns(["slot"]).to_pylist(), level_offsets, delays, now), timer_hi


def _plan(
    candidates: list[dict[str, Any]], level_offsets: dict[int, int], delays: dict[int, int], now: int
) -> list[dict[str, Any]]:
    """The candidates a pass promotes (``promote.plan_due`` with ``store_at``): every timer;
    of each level, the run of consecutive offsets from its saved one, each stored at its
    due time or, when that has passed or clock-corrected (due after ``now`` plus the
    level's delay), at ``now``."""
    out: list[dict[str, Any]] = []
    by_level: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in candidates:
        if r["topic"] == SCHEDULE_TOPIC:
            by_level[r["queue_id"]].append(r)
        else:
            out.append(_entry(r, ids.KIND_TIMER, max(r["due_ts"], now)))
    for q, rows in by_level.items():
        rows.sort(key=lambda r: r["queue_offset"])
        base = level_offsets.get(q, 0)
        for k, r in enumerate(rows):
            if r["queue_offset"] - base != k:
                break  # the pass stops at the first entry not yet due
            corrected = r["due_ts"] > corrected_after(now, delays.get(q, 0))
            out.append(_entry(r, q + 1, now if corrected else max(r["due_ts"], now)))
    return out


def _entry(r: dict[str, Any], kind: int, store_at: int) -> dict[str, Any]:
    props = dict(r["properties"] or ())
    real = props.get(Prop.REAL_TOPIC)
    return r | {
        "properties": props,
        "kind": kind,
        "skip": real is None or real == TRANS_HALF_TOPIC,
        "store_at": store_at,
        "real_topic": real,
        "real_qid": props.get(Prop.REAL_QID),
    }


def summary_rows(entries: Iterable[dict[str, Any]], timer_hi: int | None) -> list[dict[str, Any]]:
    """The rows ``promote._summary`` makes in the engine: the entries grouped by source
    queue, skip, real queue, body batch and times (``n``, the highest offset ``hi``),
    and a row with the timer queue's highest offset (``topic`` None)."""
    keys = SUMMARY_KEYS
    groups: dict[tuple[Any, ...], list[int]] = {}
    for e in entries:
        g = groups.setdefault(tuple(e[k] for k in keys), [0, e["queue_offset"]])
        g[0] += 1
        g[1] = max(g[1], e["queue_offset"])
    rows = [dict(zip(keys, k, strict=True)) | {"n": n, "hi": hi} for k, (n, hi) in groups.items()]
    return [*rows, dict.fromkeys(keys) | {"n": None, "hi": timer_hi}]


def copy_id(e: dict[str, Any]) -> str:
    """The msg id of an entry's copy (as ``promote.plan_messages`` derives it)."""
    return ids.msg_id(ids.engine_batch_id(e["due_ts"], e["kind"]), e["queue_offset"] & 0xFFFFFFFF)


def stored_ids(
    wh: Snapshots, ranges: Sequence[tuple[int, int]], more_days: Iterable[date] = ()
) -> set[str] | None:
    """``commit_log`` msg ids whose batch id encodes a time in ``ranges``, stored on those
    times' days or on ``more_days`` (as ``bodies.stored_ids`` reads them through the
    engine)."""
    spans = batch_spans(ranges)
    days = {d.isoformat() for d in store_days(ranges) | set(more_days)}
    found = file_reads.rows(
        wh,
        "commit_log",
        ["msg_id"],
        file_reads.balanced_or(
            ((pc.field("batch_id") >= lo) & (pc.field("batch_id") <= hi) for lo, hi in spans),
            pc.scalar(False),
        ),
        lambda f: (
            f.partition.get("store_date") in days and any(f.overlaps("batch_id", lo, hi) for lo, hi in spans)
        ),
    )
    return None if found is None else set(found.column("msg_id").to_pylist())


def copies(wh: Snapshots, entries: Sequence[dict[str, Any]], skip_ids: set[str]) -> pa.Table | None:
    """The ``commit_log`` rows of the copies of ``entries`` (those not skipped, whose id is
    not in ``skip_ids`` and whose source body is still there), as ``promote.plan_messages``
    builds them; None when a real queue id is not a plain number (the engine decides
    what such a value means)."""
    todo = [e for e in entries if not e["skip"] and copy_id(e) not in skip_ids]
    if any(not _plain_int(e["real_qid"]) for e in todo):
        return None
    index = pa.table(
        {
            "cl_date": pa.array([e["cl_date"] for e in todo], pa.date32()),
            "cl_batch_id": pa.array([e["cl_batch_id"] for e in todo], pa.int64()),
            "cl_batch_pos": pa.array([e["cl_batch_pos"] for e in todo], pa.int64()),
            "msg_id": pa.array([e["msg_id"] for e in todo], pa.string()),
            "_e": pa.array(range(len(todo)), pa.int64()),
        }
    )
    joined = file_reads.bodies(wh, index, RESTORED)
    if joined is None:
        return None
    src = joined.to_pylist()
    rows: dict[str, list[Any]] = {f.name: [] for f in COMMIT_LOG_ARROW}
    for b in src:
        e = todo[b["_e"]]
        batch = ids.engine_batch_id(e["due_ts"], e["kind"])
        pos = e["queue_offset"] & 0xFFFFFFFF
        props = [(k, v) for k, v in (b["properties"] or ()) if k not in REMOVED_PROPS]
        values = {
            "msg_id": ids.msg_id(batch, pos),
            "topic": e["real_topic"],
            "queue_id": int(e["real_qid"]),
            "properties": props,
            "store_ts": e["store_at"],
            "batch_id": batch,
            "batch_pos": pos,
            "store_date": ids.store_date(e["store_at"]),
        }
        for name, column in rows.items():
            column.append(values[name] if name in values else b[name])
    return pa.table(rows, schema=COMMIT_LOG_ARROW)


def _plain_int(text: Any) -> bool:
    """Whether a property is a decimal number an INT holds, spelled plainly (a cast in any
    engine reads it the same)."""
    return isinstance(text, str) and text.isascii() and text.isdigit() and int(text) < (1 << 31)
