"""What a deliver pass takes and what comes back (deltamq/jobs/deliver.py runs the pass):
the take's rows and summary (:class:`Taken`), the messages not consumed
(:class:`Failed`) and the listeners' outcomes summed up (:class:`Consumed`), with the
rows the take itself sends back or holds (poison heads, later copies of a key, what a
timed-out listener left)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from deltamq.constants import NOT_HANDED_OVER, FailReason
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

    failures: tuple[Failed, ...] = ()
    keys: tuple[tuple[str, str, str], ...] = ()
    handed_over: int = 0  # messages the listeners dealt with (not what a timeout left)
    body_bytes: int = 0  # their bodies' bytes
    consumed: Mapping[str, int] = field(default_factory=dict)  # per group


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
    consumed = body_bytes = 0
    for r in rows:
        if r["kind"] == "fail":
            failures.append(Failed.of(r))
        elif r["kind"] == "key":
            keys.append((r["consumer_group"], r["dkey"], r["msg_id"]))
        else:
            consumed += r["n"]
            body_bytes += r["nbytes"] or 0
            by_group[r["consumer_group"]] = by_group.get(r["consumer_group"], 0) + r["n"]
    if consumed + len(failures) != n_deliverable:
        raise RuntimeError(
            f"deliver: {n_deliverable} messages taken but {consumed + len(failures)} outcomes; "
            "bodies missing?"
        )
    left = sum(1 for f in failures if f.reason in NOT_HANDED_OVER)
    return Consumed(tuple(failures), tuple(keys), n_deliverable - left, body_bytes, by_group)


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


def deferred(ctx: Context, taken: Taken, failures: Iterable[Failed]) -> tuple[list[Failed], list[Failed]]:
    """The messages a timed-out listener left (``DEFERRED``), as (held, left below): a
    queue holds from its first deferred message above every other one the pass matched
    there (a concurrent group's queue spreads over partitions); holding lower would hand
    the handled ones out again, so those below go the send-back way (a BROADCASTING
    instance's are logged and dropped, as its failures are)."""
    by_queue: dict[QueueKey, list[Failed]] = defaultdict(list)
    for o in failures:
        if o.reason == FailReason.DEFERRED:
            by_queue[o.queue].append(o)
    if not by_queue:
        return [], []
    seen: dict[QueueKey, list[int]] = defaultdict(list)
    lows = {q: min(o.delivered.queue_offset for o in v) for q, v in by_queue.items()}
    above = " OR ".join(  # only rows above a queue's lowest deferred one matter
        f"(topic = {sql_str(q.topic)} AND queue_id = {int(q.queue_id)} AND queue_offset > {int(lo)})"
        for q, lo in lows.items()
    )
    for r in _taken_rows(
        ctx,
        taken,
        pc.field("matched"),
        f"matched AND ({above})",
        "consumer_group, client_id, topic, queue_id, queue_offset",
    ):
        seen[QueueKey(r["consumer_group"], r["client_id"] or "", r["topic"], r["queue_id"])].append(
            r["queue_offset"]
        )
    holds = held_from({q: {o.delivered.queue_offset for o in v} for q, v in by_queue.items()}, seen)
    held: list[Failed] = []
    below: list[Failed] = []
    for q, v in by_queue.items():
        for o in v:
            (held if q in holds and o.delivered.queue_offset >= holds[q] else below).append(o)
    return held, below


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
