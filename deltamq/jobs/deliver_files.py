"""Deliver's take and its listener calls from the tables' files, for small passes.

A pass that takes a few hundred messages (timers falling due, a trickle of sends) spent
most of its ~160 ms in engine statements: the take with its summary, then the listener
call inside the engine with the bodies joined (``mapInArrow``). Here the take's index
rows are read from the kept ``consume_queue`` snapshot (the files the ranges lie in),
matched against the tag subscriptions in Python, their bodies read from
``commit_log``'s files, and handed to the same partition function
(``consume_partition.make_consumer``) in this process, whose listener calls go to
isolated worker processes of the same kind (this process's pool; the embedded server
keeps its own). The outcomes are the same rows the engine collects.

Two ways, one result; this one is taken only when it gives what the engine's gives:
the embedded engine (listeners run in this machine's worker processes either way),
no SQL92 subscription and no de-duplication key among the pass's groups (their
matching is the engine's), at most :data:`MAX_MESSAGES` taken, and tables the file
reader can read. Otherwise None, and deliver goes through the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deltamq import file_reads
from deltamq.body_reads import FILE, ROW, BodyFiles
from deltamq.delta_read import picked
from deltamq.jobs import consume_partition
from deltamq.jobs.deliver_plan import QueueTake

if TYPE_CHECKING:
    from deltamq.config import GroupConfig
    from deltamq.file_reads import Snapshots

MAX_MESSAGES = 10_000
"""Messages a pass may take and still have their bodies read here; a larger pass is
delivered here only on a local disk, each listener worker reading its chunks' bodies
itself (elsewhere it is the engine's)."""
PLACE_ROWS = 65_536
"""Rows of a file below which :func:`by_place` does not cut it between tables (a few
row groups: one worker decodes them faster than two start on them)."""
_INDEX = file_reads.HANDOUT_INDEX_COLUMNS
_BODY = file_reads.HANDOUT_BODY_COLUMNS


def eligible(
    groups: dict[str, GroupConfig], takes: Sequence[QueueTake], embedded: bool, local: bool = False
) -> bool:
    """Whether a pass may be delivered from the files (module docstring); ``local``: the
    warehouse is on a local disk, where a large pass's workers read their bodies."""
    return (
        embedded
        and bool(takes)
        and all(t.sql92 is None for t in takes)
        and not any(cfg.dedup_key for cfg in groups.values())
        and (local or sum(t.hi - t.lo for t in takes) <= MAX_MESSAGES)
    )


def taken_rows(wh: Snapshots, takes: Sequence[QueueTake]) -> pa.Table | None:
    """The index rows of every take, with ``consumer_group``, ``client_id``, ``matched``
    (its tag subscription), ``poison`` (a head whose attempts keep ending without an
    outcome), ``dup`` and ``later`` (False: no de-duplication here), ``suspends`` (the orderly head's
    count) and ``dkey`` (null), as ``deliver.take`` leaves them in its view; None when
    ``consume_queue`` must be read with the engine."""
    found = file_reads.index_by_range(wh, [(t.topic, t.queue_id, t.lo, t.hi) for t in takes], _INDEX)
    if found is None:
        return None
    parts = []
    for t, rows in zip(takes, found, strict=True):
        n = rows.num_rows
        if t.tags is None:
            matched = pa.repeat(pa.scalar(True, pa.bool_()), n)
        else:
            matched = pc.fill_null(pc.is_in(rows.column("tags"), pa.array(list(t.tags), pa.string())), False)
        head = pc.equal(rows.column("queue_offset"), t.lo)
        suspends = pc.if_else(head, pa.scalar(t.suspends, pa.int32()), pa.scalar(0, pa.int32()))
        columns = {
            "consumer_group": pa.repeat(pa.scalar(t.group, pa.string()), n),
            "client_id": pa.repeat(pa.scalar(t.client, pa.string()), n),
            **{c: rows.column(c) for c in rows.column_names},
            "matched": matched,
            "poison": pa.repeat(pa.scalar(t.poison, pa.bool_()), n),
            "dup": pa.repeat(pa.scalar(False, pa.bool_()), n),
            "later": pa.repeat(pa.scalar(False, pa.bool_()), n),
            "suspends": suspends,
            "dkey": pa.nulls(n, pa.string()),
        }
        parts.append(pa.table(columns))
    return pa.concat_tables(parts)


def summary(taken: pa.Table) -> list[dict[str, Any]]:
    """``deliver.take``'s summary: rows per group, outcome class and body batch (``n``)."""
    keys = ["consumer_group", "matched", "poison", "dup", "later", "cl_date", "cl_batch_id"]
    grouped = (
        taken.select([*keys, "queue_offset"])
        .group_by(keys, use_threads=False)
        .aggregate([("queue_offset", "count")])
    )
    return [r | {"n": r.pop("queue_offset_count")} for r in grouped.to_pylist()]


def consume(
    wh: Snapshots,
    taken: pa.Table,
    consumer_for: Callable[[BodyFiles | None], Any],
    parallel: int = 1,
    orderly: bool = True,
) -> list[dict[str, Any]] | None:
    """The deliverable rows of ``taken`` with their bodies, through the partition
    function ``consumer_for`` gives, whole queues split into at most ``parallel``
    partitions called at once (threads: the listeners run in worker processes, as the
    engine's partitions call them on every core); its output rows, as the engine's
    ``collect`` gives them (rows whose body is gone are left out, as the engine's join
    leaves them); None when ``commit_log`` must be read with the engine. More than
    :data:`MAX_MESSAGES` rows go with where their bodies lie, and the listener workers
    read them (``file_reads.located``, deltamq/body_reads.py): a million bodies are
    never in this process, nor in a pipe. Unless the pass has an ``orderly`` group (whose
    partitions hold whole queues), such rows are split by where they lie
    (:func:`by_place`), so each row group is decoded by one worker, once."""
    wanted = pc.and_(taken.column("matched"), pc.invert(pc.or_(taken.column("poison"), taken.column("dup"))))
    rows = taken if pc.all(wanted).as_py() is not False else taken.filter(wanted)
    files: BodyFiles | None = None
    if rows.num_rows > MAX_MESSAGES:
        placed = file_reads.located(wh, rows, _BODY, by_place=not orderly)
        if placed is None:
            return None
        joined, files = placed
    else:
        found = file_reads.bodies(wh, rows, _BODY)  # the index rows carry none of the body columns
        if found is None:
            return None
        joined = found
    if joined.num_rows == 0:
        return []
    names = ["consumer_group", "client_id", *consume_partition.message_columns(joined, files)]
    msgs = joined.select([*names, "cl_date", "cl_batch_id", "cl_batch_pos", "dkey"])
    consumer = consumer_for(files)
    parts = by_place(msgs, parallel) if files is not None and not orderly else partitions(msgs, parallel)
    if len(parts) == 1:  # (by place, the one table is the rows arranged)
        out = list(consumer(iter(parts[0].to_batches())))
    else:
        with ThreadPoolExecutor(len(parts), thread_name_prefix="deltamq-deliver") as pool:
            done = list(pool.map(lambda part: list(consumer(iter(part.to_batches()))), parts))
        out = [b for batches in done for b in batches]
    return pa.Table.from_batches(out).to_pylist() if out else []


def partitions(rows: pa.Table, most: int) -> list[pa.Table]:
    """``rows`` split into at most ``most`` tables of whole queues (group, instance, topic,
    queue), the queues dealt out largest first to the emptiest table (rows of a queue
    that lie together are shared, not copied: ``delta_read.picked``)."""
    if most <= 1 or rows.num_rows == 0:
        return [rows]
    key = _codes(rows, ("consumer_group", "client_id", "topic", "queue_id"))
    queues, first, home_of, sizes = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    if len(queues) <= 1:
        return [rows]
    loads = [0] * min(most, len(queues))
    homes = np.zeros(len(queues), dtype=np.int64)
    for q in sorted(range(len(queues)), key=lambda q: (-sizes[q], first[q])):  # largest first, then as met
        i = loads.index(min(loads))
        homes[q] = i
        loads[i] += int(sizes[q])
    place = homes[home_of]
    return [picked(rows, np.flatnonzero(place == i)) for i in range(len(loads))]


def by_place(rows: pa.Table, most: int) -> list[pa.Table]:
    """Located ``rows`` (``body_reads.FILE`` / ``ROW`` columns) of concurrent groups split
    into at most ``most`` tables by where their bodies lie: whole files (cut into row
    ranges of at least :data:`PLACE_ROWS` when there are fewer files than tables) dealt
    out largest first to the emptiest table, each table's rows by group and instance,
    then file and row. A worker then meets a row group's rows together and decodes it
    once, where a split by queue had every worker decode every group of a file whose
    rows mix the queues (an engine's ``send_dataframe``). Concurrent groups need no
    whole queues (the engine's pass spreads them evenly too)."""
    n = rows.num_rows
    file = rows.column(FILE).to_numpy().astype(np.int64)
    row = rows.column(ROW).to_numpy().astype(np.int64)
    files = int(file.max()) + 1 if n else 0
    last = int(row.max()) if n else 0
    # ranges per file: as many as tables per file, each of at least PLACE_ROWS rows
    cuts = 1 if files >= most else max(1, min(-(-most // max(files, 1)), (last + 1) // PLACE_ROWS))
    span = last // cuts + 1
    unit = file * cuts + row // span
    sizes = np.bincount(unit, minlength=files * cuts)
    homes = np.zeros(len(sizes), dtype=np.int64)
    loads = [0] * max(1, min(most, int(np.count_nonzero(sizes))))
    for u in sorted(np.flatnonzero(sizes).tolist(), key=lambda u: (-sizes[u], u)):
        i = loads.index(min(loads))
        homes[u] = i
        loads[i] += int(sizes[u])
    group = _codes(rows, ("consumer_group", "client_id"))
    packed = (int(group.max()) + 1 if n else 1) * max(files, 1) < 1 << 23 and last < 1 << 40
    key = ((group * max(files, 1) + file) << 40) | row if packed else None
    place = homes[unit]
    out = []
    for i in range(len(loads)):
        mine = np.flatnonzero(place == i)
        if key is None:  # (more groups and files than one int64 holds with the rows)
            mine = mine[np.lexsort((row[mine], file[mine], group[mine]))]
        elif len(mine) > 1 and bool(np.any(key[mine][1:] < key[mine][:-1])):
            mine = mine[np.argsort(key[mine], kind="stable")]
        out.append(picked(rows, mine))
    return out


def _codes(rows: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """Each row's code of its values in ``columns``: equal values, equal codes (int64,
    made dense again where the product of the columns' distinct values would not fit)."""
    key = np.zeros(rows.num_rows, dtype=np.int64)
    for c in columns:
        codes = pc.dictionary_encode(rows.column(c), null_encoding="encode").combine_chunks()
        if (int(key.max(initial=0)) + 1) * len(codes.dictionary) >= 1 << 62:  # below the rows' count
            key = np.unique(key, return_inverse=True)[1].astype(np.int64)
        key = key * len(codes.dictionary) + codes.indices.to_numpy().astype(np.int64)
    return key
