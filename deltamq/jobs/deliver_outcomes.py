"""What a deliver pass takes and what comes back (deltamq/jobs/deliver.py runs the pass):
the take's rows and summary (:class:`Taken`), the messages not consumed
(:class:`Failed`) and the listeners' outcomes summed up (:class:`Consumed`), with the
rows the take itself sends back or holds (poison heads, later copies of a key, what a
timed-out listener left)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from deltamq.constants import FailReason
from deltamq.jobs import sendback
from deltamq.jobs.deliver_plan import POISON_TRIES, held_from
from deltamq.tables.offsets import QueueKey
from deltamq.tables.sqltext import sql_str

if TYPE_CHECKING:
    from deltamq.context import Context


Counts = Mapping[str, Mapping[str, int]]
"""Per group, messages per outcome (``consumed``, ``filtered``, ``retried``, ...)."""


def counts_of(pairs: Iterable[tuple[str, str, int]]) -> dict[str, dict[str, int]]:
    """(group, outcome, n) triples summed into :data:`Counts`."""
    out: dict[str, dict[str, int]] = {}
    for group, outcome, n in pairs:
        by = out.setdefault(group, {})
        by[outcome] = by.get(outcome, 0) + n
    return out


@dataclass(frozen=True)
class Taken:
    """The take, filtered: its rows in the temp view ``view`` (of the pass's scope),
    summarised per group, outcome class and body batch; what the take itself counted
    (``filtered``, ``deduplicated``)."""

    view: str
    summary: tuple[Any, ...]
    deliverable: tuple[Any, ...]  # summary rows of messages the listeners get
    counts: Counts
    table: pa.Table | None = None  # the rows themselves, when read from the files (no view)

    @property
    def rows(self) -> int:
        return sum(r["n"] for r in self.summary)


@dataclass(frozen=True)
class Failed:
    """A message a pass did not consume: its delivery and how it failed (``reason`` None:
    the listener answered RECONSUME_LATER, asking for ``level``)."""

    group: str
    client: str
    delivered: sendback.Delivered
    level: int
    reason: FailReason | None
    error: str | None

    @classmethod
    def of(cls, row: Any, reason: FailReason | None = None) -> Failed:
        """From an output or index row (``consumer_group``, ``client_id``, the delivery
        columns; ``level``, ``reason``, ``error`` where it has them)."""
        fields = row.asDict() if hasattr(row, "asDict") else dict(row)
        given = fields.get("reason")
        return cls(
            fields["consumer_group"],
            fields["client_id"] or "",
            sendback.Delivered.of(fields),
            fields.get("level") or 0,
            reason if reason is not None else (FailReason(given) if given else None),
            fields.get("error"),
        )

    @property
    def queue(self) -> QueueKey:
        return QueueKey(self.group, self.client, self.delivered.topic, self.delivered.queue_id)


@dataclass(frozen=True)
class Consumed:
    """The listeners' outcomes, materialised once: failures (one each), the keys of the
    messages consumed by de-duplicating groups, and messages consumed per group."""

    failures: tuple[Failed, ...] = ()  # (never SETUP: those are in ``setup``)
    keys: tuple[tuple[str, str, str], ...] = ()
    handed_over: int = 0  # messages the listeners dealt with (not what a timeout left, nor SETUP)
    body_bytes: int = 0  # their bodies' bytes
    consumed: Mapping[str, int] = field(default_factory=dict)  # per group
    deferred: Mapping[QueueKey, tuple[int, ...]] = field(default_factory=dict)
    """Per queue, the offsets a timed-out listener left untried (``DEFERRED``)."""
    held: Mapping[QueueKey, int] = field(default_factory=dict)
    """Per orderly queue, its lowest offset not handed over (``NOT_DELIVERED``)."""
    setup: Mapping[QueueKey, tuple[int, int, str]] = field(default_factory=dict)
    """Per queue of a group whose listener could not be loaded (``SETUP``): its lowest
    offset, how many messages, and why (nothing consumed: the queue is held)."""


def taken_of(view: str, summary: list[Any], table: pa.Table | None = None) -> Taken:
    """A :class:`Taken` from the take's summary rows (group, matched, poison, dup, body
    batch, ``n``): what goes to the listeners and what the take itself counted."""
    counted = []
    deliverable = []
    for r in summary:
        if not r["matched"]:
            counted.append((r["consumer_group"], "filtered", r["n"]))
        elif r["poison"]:
            pass
        elif r["dup"]:
            counted.append((r["consumer_group"], "deduplicated", r["n"]))
        elif r["later"]:
            counted.append((r["consumer_group"], "later_copies", r["n"]))
        else:
            deliverable.append(r)
    return Taken(view, tuple(summary), tuple(deliverable), counts_of(counted), table)


def outcomes(rows: Iterable[Any], n_deliverable: int) -> Consumed:
    """The partition function's output rows summed up: failures, keys, counts; every
    deliverable message must have its outcome."""
    failures: list[Failed] = []
    keys: list[tuple[str, str, str]] = []
    by_group: dict[str, int] = {}
    deferred: dict[QueueKey, list[int]] = defaultdict(list)
    held: dict[QueueKey, int] = {}
    setup: dict[QueueKey, tuple[int, int, str]] = {}
    consumed = body_bytes = untried = not_loaded = 0
    for r in rows:
        setup_failure = r["kind"] == "fail" and r["reason"] == FailReason.SETUP.value
        if r["kind"] == "fail" and not setup_failure:
            failures.append(Failed.of(r))
        elif r["kind"] == "key":
            keys.append((r["consumer_group"], r["dkey"], r["msg_id"]))
        elif r["kind"] == "deferred":
            deferred[_queue_of(r)] += r["offsets"]
            untried += len(r["offsets"])
        elif r["kind"] == "held":
            q = _queue_of(r)
            held[q] = min(held.get(q, r["queue_offset"]), r["queue_offset"])
            untried += r["n"]
        elif r["kind"] == "setup" or setup_failure:  # (a row per message, or per queue)
            q, count = _queue_of(r), 1 if setup_failure else r["n"]
            at, n, why = setup.get(q, (r["queue_offset"], 0, r["error"] or ""))
            setup[q] = (min(at, r["queue_offset"]), n + count, why)
            not_loaded += count
        elif r["kind"] == "count":
            consumed += r["n"]
            body_bytes += r["nbytes"] or 0
            by_group[r["consumer_group"]] = by_group.get(r["consumer_group"], 0) + r["n"]
        else:  # (a worker of another version, say): never counted as consumed
            raise RuntimeError(f"deliver: an outcome of unknown kind {r['kind']!r}")
    if consumed + len(failures) + not_loaded + untried != n_deliverable:
        raise RuntimeError(
            f"deliver: {n_deliverable} messages taken but {consumed + len(failures) + not_loaded + untried} "
            "outcomes; bodies missing?"
        )
    return Consumed(
        tuple(failures),
        tuple(keys),
        n_deliverable - untried - not_loaded,  # not "deferred" / "held", nor for a listener that cannot load
        body_bytes,
        by_group,
        {q: tuple(v) for q, v in deferred.items()},
        held,
        setup,
    )


_FAILED_COLUMNS = (
    "consumer_group, client_id, topic, queue_id, queue_offset, msg_id, cl_date, "
    "cl_batch_id, cl_batch_pos, reconsume_times"
)
"""The taken rows' columns a :class:`Failed` is made of, when the take sends rows back."""


def poisoned(ctx: Context, taken: Taken) -> list[Failed]:
    """Matched messages of heads whose attempts kept ending without an outcome."""
    if not any(r["matched"] and r["poison"] for r in taken.summary):
        return []
    error = f"{POISON_TRIES} delivery attempts ended without an outcome"
    found = _taken_rows(ctx, taken, pc.field("poison") & pc.field("matched"), "poison AND matched")
    return [replace(Failed.of(r, FailReason.POISON), error=error) for r in found]


def _taken_rows(
    ctx: Context, taken: Taken, where: pc.Expression, sql: str, columns: str = _FAILED_COLUMNS
) -> list[Any]:
    """The taken rows ``where`` (the same condition as ``sql`` over the view), ``columns``."""
    if taken.table is not None:
        found: list[Any] = taken.table.filter(where).select(columns.split(", ")).to_pylist()
        return found
    return ctx.engine.rows(f"SELECT {columns} FROM {taken.view} WHERE {sql}")


def deferred(
    ctx: Context, taken: Taken, left: Mapping[QueueKey, Collection[int]]
) -> tuple[dict[QueueKey, int], list[Failed]]:
    """What a timed-out listener ``left`` untried (``DEFERRED``, per queue), as (the
    offset each queue holds from, the messages sent back): a queue holds from its first
    deferred message above every other one the pass matched there (a concurrent group's
    queue spreads over partitions); holding lower would hand the handled ones out again,
    so those below go the send-back way (a BROADCASTING instance's are logged and
    dropped, as its failures are). The usual case, a queue whose matched messages from
    its lowest deferred one on were all deferred, is told by a count; only the others'
    offsets are read, and only the messages sent back are read whole."""
    if not left:
        return {}, []
    sets = {q: set(v) for q, v in left.items()}
    counts = _matched_from(ctx, taken, sets)
    holds = {q: min(v) for q, v in sets.items() if counts.get(q, 0) == len(v)}
    mixed = {q: v for q, v in sets.items() if q not in holds}
    if not mixed:
        return holds, []
    seen: dict[QueueKey, list[int]] = defaultdict(list)
    for r in _taken_rows(
        ctx,
        taken,
        pc.field("matched"),
        f"matched AND ({_from_sql(mixed)})",
        "consumer_group, client_id, topic, queue_id, queue_offset",
    ):
        seen[_queue_of(r)].append(r["queue_offset"])
    holds |= held_from(mixed, seen)
    below = {q: {o for o in v if q not in holds or o < holds[q]} for q, v in mixed.items()}
    below = {q: v for q, v in below.items() if v}
    if not below:
        return holds, []
    sent = [
        Failed.of(r, FailReason.DEFERRED)
        for r in _taken_rows(ctx, taken, pc.field("matched"), f"matched AND ({_from_sql(below)})")
        if r["queue_offset"] in below.get(_queue_of(r), ())
    ]
    return holds, sent


def _matched_from(
    ctx: Context, taken: Taken, offsets: Mapping[QueueKey, Collection[int]]
) -> dict[QueueKey, int]:
    """Per queue, the matched rows of the take from the lowest of its ``offsets`` on."""
    if taken.table is not None:
        lows = {q: min(v) for q, v in offsets.items()}
        out: dict[QueueKey, int] = defaultdict(int)
        for r in (
            taken.table.filter(pc.field("matched"))
            .select(["consumer_group", "client_id", "topic", "queue_id", "queue_offset"])
            .to_pylist()
        ):
            q = _queue_of(r)
            if q in lows and r["queue_offset"] >= lows[q]:
                out[q] += 1
        return out
    rows = ctx.engine.rows(
        f"SELECT consumer_group, client_id, topic, queue_id, count(*) AS n FROM {taken.view} "
        f"WHERE matched AND ({_from_sql(offsets)}) GROUP BY consumer_group, client_id, topic, queue_id"
    )
    return {_queue_of(r): r["n"] for r in rows}


def _queue_of(row: Any) -> QueueKey:
    return QueueKey(row["consumer_group"], row["client_id"] or "", row["topic"], row["queue_id"])


def _from_sql(offsets: Mapping[QueueKey, Collection[int]]) -> str:
    """Rows of these queues from each one's lowest offset given, as SQL over the take."""
    return " OR ".join(
        f"(consumer_group = {sql_str(q.group)} AND coalesce(client_id, '') = {sql_str(q.client)} "
        f"AND topic = {sql_str(q.topic)} AND queue_id = {int(q.queue_id)} "
        f"AND queue_offset >= {int(min(v))})"
        for q, v in offsets.items()
    )


def later_copies(ctx: Context, taken: Taken) -> list[Failed]:
    """Later copies of a de-duplication key taken in this pass (``dedup.later_copies``):
    sent back, to be checked against the first copy's outcome when they come again."""
    if not any(r["later"] for r in taken.summary):
        return []
    found = ctx.engine.rows(f"SELECT {_FAILED_COLUMNS}, dkey FROM {taken.view} WHERE later")
    return [
        replace(
            Failed.of(r, FailReason.LATER_COPY),
            error=f"a copy of key {r['dkey']!r} was taken in the same pass; checked again after it",
        )
        for r in found
    ]
