"""Deliver's listener call: the function the engine runs over each partition of the
taken messages (``mapInArrow``), inside its Python workers.

Per consumer group and instance in a partition, the rows are handed to the group's
listener in chunks (``listener_worker.consume``: an isolated worker process per call).
What comes back is small: a row per message that was not consumed ("fail": its outcome
and what the send-back needs), a row per consumed message whose group de-duplicates
("key"), one row per group and instance with the number consumed ("count"), one row
per queue with the offsets a listener left untried ("deferred", "held"), and one per
queue a listener that cannot be loaded could not take ("setup"). A pass that consumes
everything returns a handful of rows, whatever its size, and so does one whose listener
hangs or cannot be loaded.

Orderly groups' partitions hold whole queues (deliver partitions the input by queue)
and are called queue by queue in offset order; the first failing chunk suspends, and
the rest of its queue waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from deltamq.body_reads import FILE, ROW, BodyFiles
from deltamq.constants import NOT_HANDED_OVER, FailReason
from deltamq.consumer import COLUMNAR_COLUMNS
from deltamq.jobs.listener_worker import Home, Outcome, Span

OUT_ARROW = pa.schema(
    [
        ("kind", pa.string()),
        ("consumer_group", pa.string()),
        ("client_id", pa.string()),
        ("topic", pa.string()),
        ("queue_id", pa.int32()),
        ("queue_offset", pa.int64()),
        ("msg_id", pa.string()),
        ("cl_date", pa.date32()),
        ("cl_batch_id", pa.int64()),
        ("cl_batch_pos", pa.int64()),
        ("reconsume_times", pa.int32()),
        ("dkey", pa.string()),
        ("ok", pa.bool_()),
        ("level", pa.int32()),
        ("reason", pa.string()),
        ("error", pa.string()),
        ("n", pa.int64()),
        ("nbytes", pa.int64()),
        ("offsets", pa.list_(pa.int64())),  # a "deferred" row's queue offsets
    ]
)
_DDL_TYPES = {
    pa.string(): "string",
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.date32(): "date",
    pa.bool_(): "boolean",
    pa.list_(pa.int64()): "array<bigint>",
}
OUT_SCHEMA = ", ".join(f"{f.name} {_DDL_TYPES[f.type]}" for f in OUT_ARROW)
"""The engine's schema of the output (DDL), derived from :data:`OUT_ARROW`."""
ORDER = ["consumer_group", "client_id", "topic", "queue_id", "queue_offset"]
MESSAGE_COLUMNS = list(COLUMNAR_COLUMNS)
"""The columns a listener worker receives (it builds StoredMessage objects from them)."""
STREAM_ROWS = 16_384
"""Rows a partition of concurrent groups hands to its listeners at a time (the engine's
batches gathered up to this): a million bodies gathered whole before the first call
cost 1.2-1.3 s more per partition than the same rows taken as they come."""

Call = Callable[[int, int, int], list[Span]]
"""(first row, rows, chunk size) → the outcome spans of one group's listener calls."""


def out_rows(
    rows: pa.Table, kind: str, outcome: Outcome | None = None, n: int | None = None, nbytes: int | None = None
) -> pa.Table:
    """Output rows for the input ``rows`` (a pyarrow Table) with one outcome."""
    k = rows.num_rows
    const = {
        "kind": pa.array([kind] * k, pa.string()),
        "ok": pa.array([outcome.ok if outcome else None] * k, pa.bool_()),
        "level": pa.array([outcome.level if outcome else None] * k, pa.int32()),
        "reason": pa.array([outcome.reason.value if outcome and outcome.reason else None] * k, pa.string()),
        "error": pa.array([outcome.error if outcome else None] * k, pa.string()),
        "n": pa.array([n] * k, pa.int64()),
        "nbytes": pa.array([nbytes] * k, pa.int64()),
        "offsets": pa.nulls(k, pa.list_(pa.int64())),
    }
    arrays = [
        const[f.name] if f.name in const else rows.column(f.name).combine_chunks().cast(f.type)
        for f in OUT_ARROW
    ]
    return pa.Table.from_arrays(arrays, schema=OUT_ARROW)


def deferred_rows(
    rows: pa.Table, reason: FailReason = FailReason.DEFERRED, error: str | None = None
) -> pa.Table:
    """Output rows for ``rows`` a listener left untried (``DEFERRED``: it timed out; or,
    ``NOT_DELIVERED``, behind an orderly queue's stop) or could not take (``SETUP``: it
    cannot be loaded, ``error`` says why): one per queue, with its lowest offset, how
    many, and for ``DEFERRED`` the offsets (kind "deferred"; "setup"; "held" for the
    others, which only hold their queue). Not a row per message: a hanging listener
    leaves the whole rest of a partition, and one that cannot load all of it."""
    keys = ["consumer_group", "client_id", "topic", "queue_id"]
    listed = reason == FailReason.DEFERRED
    kind = "deferred" if listed else "setup" if reason == FailReason.SETUP else "held"
    grouped = rows.group_by(keys, use_threads=False).aggregate(
        [("queue_offset", "min"), ("queue_offset", "count")] + ([("queue_offset", "list")] if listed else [])
    )
    k = grouped.num_rows
    given = {
        **{c: grouped.column(c) for c in keys},
        "kind": pa.repeat(pa.scalar(kind), k),
        "queue_offset": grouped.column("queue_offset_min"),
        "reason": pa.repeat(pa.scalar(reason.value), k),
        "error": pa.repeat(pa.scalar(error, pa.string()), k),
        "ok": pa.repeat(pa.scalar(False), k),
        "n": grouped.column("queue_offset_count"),
        **({"offsets": grouped.column("queue_offset_list")} if listed else {}),
    }
    arrays = [given[f.name].cast(f.type) if f.name in given else pa.nulls(k, f.type) for f in OUT_ARROW]
    return pa.Table.from_arrays(arrays, schema=OUT_ARROW)


def runs(table: pa.Table, keys: list[str]) -> list[tuple[int, int, tuple[Any, ...]]]:
    """(start, length, key values) of the runs of equal ``keys`` in a table sorted by them."""
    counts = (
        table.select([*keys, "queue_offset"])
        .group_by(keys, use_threads=False)
        .aggregate([("queue_offset", "count")])
        .to_pylist()
    )
    out, start = [], 0
    for c in counts:
        n = c["queue_offset_count"]
        out.append((start, n, tuple(c[k] for k in keys)))
        start += n
    return out


def in_order(table: pa.Table, orderly: frozenset[str]) -> pa.Table:
    """Rows of one group and instance in offset order (orderly groups need it; for the
    others it only keeps each chunk tidy, so a partition holding a single concurrent
    group keeps its arrival order rather than paying for a copy of every body)."""
    import pyarrow.compute as pc

    single = pc.count_distinct(table.column("consumer_group")).as_py() == 1 and (
        pc.count_distinct(table.column("client_id")).as_py() == 1
    )
    if single and table.column("consumer_group")[0].as_py() not in orderly:
        return table  # (no sort: 0.1 s of a pass of a million rows in four pieces)
    order = pc.sort_indices(table.select(ORDER), [(c, "ascending") for c in ORDER])
    if pc.all(pc.equal(order, pa.array(range(table.num_rows), pa.uint64()))).as_py():
        return table
    # (take on a table of many chunks is pathologically slow: 4.5 s for 1M rows of
    # 1 KiB, 0.2 s once combined)
    return table.combine_chunks().take(order)


def orderly_spans(call: Call, table: pa.Table, start: int, length: int, batch: int) -> list[Span]:
    """One orderly group's rows ``[start, start + length)``, queue by queue in chunks of
    ``batch``: a chunk with a failure is suspended whole (RocketMQ) from its first failed
    message (messages before it succeeded alone, after their worker died: ``call`` tries
    them one at a time, in order), and the rest of its queue is not delivered. A listener
    that cannot be loaded suspends nothing: the queue is held (``SETUP``), as for any
    group, and no suspend counts towards the dead-letter queue; nor does a queue whose
    chunk was not handed over (``NOT_DELIVERED``: the listener timed out on an earlier
    queue of the partition)."""
    spans: list[Span] = []
    for q_start, q_len, _ in runs(table.slice(start, length), ["topic", "queue_id"]):
        q_start += start
        for lo in range(q_start, q_start + q_len, batch):
            n = min(batch, q_start + q_len - lo)
            got = call(lo, n, n)
            first = next((k for k, (_, _, o) in enumerate(got) if not o.ok), None)
            if first is None:
                spans += got
                continue
            spans += got[:first]
            at, _, o = got[first]
            if o.reason == FailReason.NOT_DELIVERED:  # not handed over (a timeout before): held
                spans.append((at, q_start + q_len - at, o))
                break
            setup = any(f.reason == FailReason.SETUP for _, _, f in got[first:])
            reason = FailReason.SETUP if setup else FailReason.SUSPEND
            spans.append((at, lo + n - at, Outcome(False, reason=reason, error=o.error)))
            if lo + n < q_start + q_len:
                spans.append(
                    (lo + n, q_start + q_len - lo - n, Outcome(False, reason=FailReason.NOT_DELIVERED))
                )
            break
    return spans


def outputs(
    table: pa.Table, messages: pa.Table, spans: list[Span], start: int, length: int, read_bytes: int = 0
) -> list[pa.Table]:
    """The output rows of one group's spans: failures, de-duplication keys, its count
    (with the bytes handed over: of the bodies, or ``read_bytes``, what the workers
    said they read, when the messages carry no body)."""
    import pyarrow.compute as pc

    out = []
    consumed = 0
    for lo, n, o in spans:
        rows = table.slice(lo, n)
        if o.ok:
            consumed += n
            keyed = rows.filter(pc.is_valid(rows.column("dkey")))
            if keyed.num_rows:
                out.append(out_rows(keyed, "key"))
        elif o.reason in NOT_HANDED_OVER:
            out.append(deferred_rows(rows, o.reason))
        elif o.reason == FailReason.SETUP:  # nothing consumed, nothing to send back: held
            out.append(deferred_rows(rows, o.reason, o.error))
        else:
            out.append(out_rows(rows, "fail", o))
    if "body" in messages.column_names:
        body = messages.column("body")
        body_bytes = sum(
            pc.sum(pc.binary_length(body.slice(lo, n))).as_py() or 0
            for lo, n, o in spans
            if o.reason not in NOT_HANDED_OVER and o.reason != FailReason.SETUP
        )
    else:  # the workers read the bodies (body_reads) and said how many bytes
        body_bytes = read_bytes
    out.append(out_rows(table.slice(start, 1), "count", n=consumed, nbytes=body_bytes))
    return out


def until_timeout(call: Call, stopped: set[tuple[str, str]], key: tuple[str, str], in_order: bool) -> Call:
    """``call`` until one of its calls for ``key`` (group, instance) times out; after that
    the partition's further rows of ``key`` are not handed over (``DEFERRED``, or
    ``NOT_DELIVERED`` in order): the timeouts of one call per partition, not of every call."""

    def guarded(lo: int, n: int, size: int) -> list[Span]:
        if key in stopped:
            rest = FailReason.NOT_DELIVERED if in_order else FailReason.DEFERRED
            return [(lo, n, Outcome(False, reason=rest))]
        spans = call(lo, n, size)
        if any(o.reason == FailReason.TIMEOUT for _, _, o in spans):
            stopped.add(key)
        return spans

    return guarded


def _pieces(batches: Iterable[pa.RecordBatch], rows: int | None) -> Iterator[pa.Table]:
    """The engine's ``batches`` gathered into tables of at least ``rows`` rows as they
    come (the last one smaller), or, with None, into one table."""
    held: list[pa.RecordBatch] = []
    n = 0
    for b in batches:
        held.append(b)
        n += b.num_rows
        if rows is not None and n >= rows:
            yield pa.Table.from_batches(held)
            held, n = [], 0
    if held:
        yield pa.Table.from_batches(held)


def message_columns(table: pa.Table, files: BodyFiles | None) -> list[str]:
    """The columns of ``table`` a listener worker gets: :data:`MESSAGE_COLUMNS`, or with
    ``files`` those of them the rows carry and where their bodies lie."""
    if files is None:
        return MESSAGE_COLUMNS
    return [*(c for c in MESSAGE_COLUMNS if c in table.column_names), FILE, ROW]


def make_consumer(
    listeners: dict[str, bytes],
    batch: dict[str, int],
    timeout_s: dict[str, float],
    tries: int,
    orderly: frozenset[str] = frozenset(),
    home: Home | None = None,
    files: BodyFiles | None = None,
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The partition function: the groups' pickled ``listeners``, chunk sizes, call time
    limits, the tries of a call, the orderly groups, where listeners run (``home``:
    the broker's environment and path, embedded engine only), and with ``files`` where
    the rows' bodies lie, for the workers to read (:func:`message_columns`).

    Orderly groups get their partition whole (queue by queue, in offset order); the
    others get it as it arrives, :data:`STREAM_ROWS` at a time (or a chunk, when a
    group's chunks are larger), so the listeners start on the first rows while the
    engine produces the rest, and a partition never holds all its bodies at once."""
    stream_rows = max(STREAM_ROWS, *batch.values()) if batch else STREAM_ROWS
    # located rows of concurrent groups come arranged by group, instance and place
    # (deliver_files.by_place), bodies not among them: whole, in that order, so one
    # worker meets a row group's rows together
    arranged = files is not None and not orderly

    def consume_partition(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        pieces = _pieces(batches, None if orderly or arranged else stream_rows)
        out: list[pa.Table] = []
        stopped: set[tuple[str, str]] = set()  # (group, instance) whose listener timed out
        for piece in pieces:
            out += _deliver(piece, stopped)
        if out:
            yield from pa.concat_tables(out).to_batches()

    def _deliver(table: pa.Table, stopped: set[tuple[str, str]]) -> list[pa.Table]:
        from deltamq.jobs.listener_worker import consume

        if table.num_rows == 0:
            return []
        table = table if arranged else in_order(table, orderly)
        messages = table.select(message_columns(table, files))
        out = []
        for start, length, (group, client) in runs(table, ["consumer_group", "client_id"]):
            read = [0]  # bytes the workers read for this group's calls

            def call(
                lo: int, n: int, size: int, group: str = group, client: str = client, read: list[int] = read
            ) -> list[Span]:
                spans = consume(
                    listeners[group],
                    group,
                    messages.slice(lo, n),
                    size,
                    timeout_s[group],
                    tries,
                    instance=client or None,
                    home=home,
                    in_order=group in orderly,
                    files=files,
                )
                read[0] += sum(o.nbytes for _, _, o in spans)
                return [(lo + i, k, o) for i, k, o in spans]

            guarded = until_timeout(call, stopped, (group, client), group in orderly)

            if group in orderly:
                spans = orderly_spans(guarded, table, start, length, batch[group])
            else:
                spans = guarded(start, length, batch[group])
            out += outputs(table, messages, spans, start, length, read[0])
        return out

    return consume_partition
