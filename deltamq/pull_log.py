"""The pull clients' records, as plain Python (docs/behaviour.md §6): the access lock's
entries and rule, the deliveries log's rows, and what the log says of each queue.

Spark-free on purpose: the pull protocol (deltamq/pull.py) and the Spark-free pull
client use it as they are; deltamq/tables/deliveries.py reads and writes the same rows
through the engine.
"""

from __future__ import annotations

import re
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from deltamq.constants import ACKED, ENDED, EXPIRED, INFLIGHT, NACK_REQUESTED, NACKED, REVOKED, TAKEN
from deltamq.errors import ConfigError

if TYPE_CHECKING:
    from deltamq.clock import Clock
    from deltamq.config import BrokerConfig, GroupConfig, Subscription

R = TypeVar("R")

Queue = tuple[str, int]
LogRow = tuple[Any, ...]
"""A row of the deliveries log, in the table's column order (:data:`LOG_COLUMNS`)."""

LOG_COLUMNS = (
    "consumer_group",
    "client_id",
    "topic",
    "queue_id",
    "queue_offset",
    "msg_id",
    "receipt_handle",
    "delivered_ts",
    "invisible_until",
    "state",
)
"""The deliveries table's columns (deltamq/schemas; a test holds the two together)."""
LOG_ARROW = pa.schema(
    [
        (name, pa.int32() if name == "queue_id" else pa.int64() if kind == "long" else pa.string())
        for name, kind in zip(
            LOG_COLUMNS,
            ("str", "str", "str", "int", "long", "str", "str", "long", "long", "str"),
            strict=True,
        )
    ]
)


_LOG_STRUCT = pa.struct(list(LOG_ARROW))


def log_table(rows: list[LogRow]) -> pa.Table:
    """Log rows as an Arrow table of the deliveries table's types, for one append
    (converted as one array of structs, half the time of a column at a time; a row of
    the wrong length is refused by pyarrow)."""
    if not rows:
        return LOG_ARROW.empty_table()
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.array(rows, type=_LOG_STRUCT))])


# --- the access locks -------------------------------------------------------------------------
@dataclass(frozen=True)
class LockEntry:
    owner: str
    last_access_ts: int
    last_delivered_offset: int  # the delivered offset last seen (the no-change counter's reference)
    no_change_count: int = 0
    delivered_offset: int | None = None  # the end of the owner's last reserved range


LOCK_COLUMNS = (
    "topic",
    "queue_id",
    "owner",
    "last_access_ts",
    "last_delivered_offset",
    "no_change_count",
    "delivered_offset",
)


def lock_entries(rows: Iterable[Any]) -> dict[Queue, LockEntry | None]:
    """Lock rows (:data:`LOCK_COLUMNS`) by queue; a row without an owner maps to None."""
    return {
        (r["topic"], r["queue_id"]): None
        if r["owner"] is None
        else LockEntry(
            r["owner"],
            r["last_access_ts"],
            r["last_delivered_offset"] or 0,
            r["no_change_count"] or 0,
            r["delivered_offset"],
        )
        for r in rows
    }


def decide_lock(
    entry: LockEntry | None,
    me: str,
    now: int,
    delivered: int,
    acked: int,
    *,
    timeout_ms: int,
    max_no_change: int,
) -> tuple[str, LockEntry]:
    """docs/behaviour.md §6 for one pull attempt of ``me``: ("acquired" | "owner" | "refused", the
    entry to store)."""
    if entry is None:
        return "acquired", LockEntry(me, now, delivered, 0, delivered)
    if entry.owner == me:
        return "owner", LockEntry(me, now, delivered, entry.no_change_count, entry.delivered_offset)
    if delivered == entry.last_delivered_offset:
        count, seen = entry.no_change_count + 1, entry.last_delivered_offset
    else:
        count, seen = 0, delivered
    hold_timeout = now - entry.last_access_ts > timeout_ms
    if hold_timeout or (delivered == acked and count >= max_no_change):
        return "acquired", LockEntry(me, now, delivered, 0, entry.delivered_offset)
    return "refused", LockEntry(entry.owner, entry.last_access_ts, seen, count, entry.delivered_offset)


# --- the deliveries log ---------------------------------------------------------------------
def ended(row: LogRow, state: str) -> LogRow:
    """The row that ends the delivery ``row`` (an INFLIGHT row): same handle, client,
    queue position and delivery time."""
    return (*row[:8], None, state)


def as_dict(row: LogRow) -> dict[str, Any]:
    return dict(zip(LOG_COLUMNS, row, strict=True))


def still_open(rows: Iterable[LogRow]) -> list[LogRow]:
    """The INFLIGHT rows of ``rows`` whose handle no row of ``rows`` ends (``rows``: every
    log row of the handles concerned)."""
    listed = list(rows)
    over = {r[6] for r in listed if r[9] in ENDED}
    return [r for r in listed if r[9] == INFLIGHT and r[6] not in over]


@dataclass
class QueueLog:
    """One queue's rows in the log, summed up."""

    taken_ts: int | None = None  # the latest TAKEN row: rows delivered before it are old
    inflight_lo: int | None = None  # lowest offset in flight (any epoch)
    due: int | None = None  # earliest invisible time of those in flight
    last: int | None = None  # highest offset handed out or passed since the latest TAKEN
    old_hi: int | None = None  # highest offset of rows older than the latest TAKEN
    lowest: int | None = None  # lowest offset of any row
    seen_ts: int | None = None  # the latest delivery time read (later rows came after the read)


_KEY = ["consumer_group", "topic", "queue_id"]


ENDS_ONLY = (ACKED, NACKED, EXPIRED)
"""A handle whose every row is one of these is an orphan: it ended a handout the log does
not hold (an ack a client of a deleted group appended after the group was created again,
whose handouts went with the delete; a late ack after the fold removed its handout). It
counts for nothing but the log's extent: a handout's end moves a queue's position only
with the handout in the log."""


def _handles(log: pa.Table) -> pa.Table:
    """Per handle of the log's rows (group, topic, queue, handle): whether any row is in
    each state (``t``, ``r``, ``d``, ``n``, ``i``: TAKEN, REVOKED, ended, NACK_REQUESTED,
    INFLIGHT; a null state is in none), whether every row is an ack, nack or expiry
    (``e_all``: an orphan, :data:`ENDS_ONLY`), the earliest due time, offset and
    delivery time."""
    state = log["state"]

    def of(states: Any) -> Any:
        return pc.fill_null(pc.is_in(state, pa.array(states, pa.string())), False)

    inflight, nacked = of([INFLIGHT]), of([NACK_REQUESTED])
    no_time = pa.scalar(None, log["delivered_ts"].type)
    rows = pa.table(
        {
            **{k: log[k] for k in (*_KEY, "receipt_handle", "queue_offset", "delivered_ts")},
            "t": of([TAKEN]),
            "r": of([REVOKED]),
            "d": of(list(ENDED)),
            "n": nacked,
            "i": inflight,
            "e": of(list(ENDS_ONLY)),
            "due": pc.if_else(
                inflight, log["invisible_until"], pc.if_else(nacked, log["delivered_ts"], no_time)
            ),
        }
    )
    return rows.group_by([*_KEY, "receipt_handle"], use_threads=False).aggregate(
        [(c, "any") for c in "trdni"]
        + [("e", "all"), ("due", "min"), ("queue_offset", "min"), ("delivered_ts", "min")]
    )


def summarise(log: pa.Table) -> dict[tuple[str, str, int], QueueLog]:
    """{(group, topic, queue): QueueLog} of the deliveries log's rows ``log`` (at least
    the columns group, topic, queue, ``queue_offset``, ``receipt_handle``,
    ``delivered_ts``, ``invisible_until`` and ``state``), in Arrow, with no Python object
    per row: what the engine computes per group of handles and :func:`sum_up` then sums.

    Per handle: ``ts`` its first delivery time, ``off`` its offset, ``due`` its earliest
    invisible time while INFLIGHT (the delivery time once a nack is requested), and one
    class: T (a takeover mark), R (revoked), D (ended), N (in flight, a nack requested),
    I (in flight), else D. Per queue: the latest T's time; rows delivered before it are
    old (``old_hi``), the others not revoked count for ``last``."""
    if log.num_rows == 0:
        return {}
    handles = _handles(log)
    t, r, d, n, i = (handles[f"{c}_any"] for c in "trdni")
    revoked = pc.and_not(r, t)
    ended = pc.and_(pc.and_not(pc.invert(t), r), pc.or_(d, pc.invert(pc.or_(n, i))))
    open_ = pc.and_(pc.invert(pc.or_(pc.or_(t, r), ended)), pc.or_(n, i))
    ts, off = handles["delivered_ts_min"], handles["queue_offset_min"]
    taken = (
        pa.table({**{k: handles[k] for k in _KEY}, "taken_ts": ts})
        .filter(t)
        .group_by(_KEY, use_threads=False)
        .aggregate([("taken_ts", "max")])
        .rename_columns([*_KEY, "taken_ts"])
    )
    per = pa.table(
        {
            **{k: handles[k] for k in _KEY},
            "ts": ts,
            "off": off,
            "open_off": pc.if_else(open_, off, pa.scalar(None, off.type)),
            "open_due": pc.if_else(open_, handles["due_min"], pa.scalar(None, handles["due_min"].type)),
            "revoked": revoked,
            "orphan": handles["e_all"],
        }
    ).join(taken, _KEY, join_type="left outer", use_threads=False)  # rows come back in any order:
    old = pc.fill_null(pc.less(per["ts"], per["taken_ts"]), False)  # only per's own columns below
    none = pa.scalar(None, off.type)
    per = per.append_column(
        "old_off", pc.if_else(pc.and_not(old, per["orphan"]), per["off"], none)
    ).append_column(
        "new_off", pc.if_else(pc.or_(pc.or_(old, per["revoked"]), per["orphan"]), none, per["off"])
    )
    sums = per.group_by(_KEY, use_threads=False).aggregate(
        [
            ("taken_ts", "max"),
            ("off", "min"),
            ("ts", "max"),
            ("open_off", "min"),
            ("open_due", "min"),
            ("old_off", "max"),
            ("new_off", "max"),
        ]
    )
    out = {}
    columns = [sums[c].to_pylist() for c in [*_KEY, "taken_ts_max", "off_min", "ts_max", "open_off_min",
                                             "open_due_min", "old_off_max", "new_off_max"]]  # fmt: skip
    for g, tp, q, taken_ts, lowest, seen_ts, inflight_lo, due, old_hi, last in zip(*columns, strict=True):
        out[(g, tp, q)] = QueueLog(taken_ts, inflight_lo, due, last, old_hi, lowest, seen_ts)
    return out


def sum_up(rows: Iterable[Any]) -> dict[tuple[str, str, int], QueueLog]:
    """{(group, topic, queue): QueueLog} from the log's handles, grouped, as the engine
    computes them (deltamq/tables/deliveries.py; rows of handles of one class and time
    may be merged): ``cls``, ``ts``, ``lo``, ``hi`` and ``due`` as :func:`summarise`
    says (``O``: an orphan, :data:`ENDS_ONLY`)."""
    listed = list(rows)
    out: dict[tuple[str, str, int], QueueLog] = defaultdict(QueueLog)
    for r in listed:
        if r["cls"] == "T":
            s = out[(r["consumer_group"], r["topic"], r["queue_id"])]
            if s.taken_ts is None or r["ts"] > s.taken_ts:
                s.taken_ts = r["ts"]
    for r in listed:
        s = out[(r["consumer_group"], r["topic"], r["queue_id"])]
        s.lowest = r["lo"] if s.lowest is None else min(s.lowest, r["lo"])
        s.seen_ts = r["ts"] if s.seen_ts is None else max(s.seen_ts, r["ts"])
        if r["cls"] in ("I", "N"):
            s.inflight_lo = r["lo"] if s.inflight_lo is None else min(s.inflight_lo, r["lo"])
            if r["due"] is not None:
                s.due = r["due"] if s.due is None else min(s.due, r["due"])
        if r["cls"] == "O":  # an orphan: the log's extent only (ENDS_ONLY)
            continue
        if s.taken_ts is not None and r["ts"] < s.taken_ts:
            s.old_hi = r["hi"] if s.old_hi is None else max(s.old_hi, r["hi"])
        elif r["cls"] != "R":
            s.last = r["hi"] if s.last is None else max(s.last, r["hi"])
    return dict(out)


def position(s: QueueLog | None, stored: tuple[int, int | None] | None) -> tuple[int, int]:
    """(acknowledged, delivered) of one queue: its log summary on top of its stored row."""
    acked_s, delivered_s = stored or (0, None)
    base = delivered_s if delivered_s is not None else acked_s
    if s is None:
        return acked_s, base
    if s.taken_ts is not None:  # a takeover restarted the queue where its TAKEN row says
        base = 0
    delivered = base if s.last is None else max(base, s.last + 1)
    acked = delivered if s.inflight_lo is None else min(s.inflight_lo, delivered)
    return acked, delivered


def positions_of(
    group: str,
    logs: Mapping[tuple[str, str, int], QueueLog],
    stored: Mapping[tuple[str, str, int], tuple[int, int | None]],
    wanted: Iterable[Queue] | None = None,
) -> dict[Queue, tuple[int, int]]:
    """Per queue of ``group`` (``wanted`` if given, else every queue either names):
    (acknowledged offset, delivered offset) from the log summary and the stored offsets."""
    keys = (
        set(wanted)
        if wanted is not None
        else {(t, q) for g, t, q in logs if g == group} | {(t, q) for g, t, q in stored if g == group}
    )
    return {k: position(logs.get((group, *k)), stored.get((group, *k))) for k in sorted(keys)}


def new_handle() -> str:
    """A receipt handle for a log row nobody acks (PASSED, TAKEN)."""
    return secrets.token_hex(14)


_HEX = re.compile("[0-9a-f]+")


def receipt_handles(handles: Iterable[str]) -> list[str]:
    """The distinct receipt handles of ``handles``, sorted; any that is not one (hex text)
    is refused by name. Checked all at once when every one is text (one match over them
    joined, and none empty), one by one only to name the bad one."""
    listed = [handles] if isinstance(handles, str) else list(handles)
    if not (all(isinstance(h, str) and h for h in listed) and _HEX.fullmatch("".join(listed) or "0")):
        for h in listed:
            if not isinstance(h, str) or not _HEX.fullmatch(h):
                raise ConfigError(f"{h!r} is not a receipt handle (hex text returned by pull)")
    return sorted(set(listed))


# --- the store the protocol reads and writes, and offset resets through it --------------------
RESET_OWNER = "%RESET%"
"""The owner of a lock row an offset reset released: long expired, so the next client that
pulls the queue takes it over and starts at the reset offset."""


@contextmanager
def restart_queues(store: PullStore, group: str, starts: dict[Queue, int], now: int) -> Iterator[None]:
    """An offset reset of a pull group to ``starts``, around the caller's ``offsets``
    write (the body): first what its clients hold in flight on those queues is revoked and
    a ``TAKEN`` row marks where each queue restarts (rows delivered before it no longer
    count); after the body, each owned lock row is handed to :data:`RESET_OWNER` with a
    time long past and the reset offset, so the holder, or any client, takes the queue
    over there: a busy holder at its next lock write, an idle one when a pull finds nothing
    to hand out. A client pulling meanwhile may hand out from its old position once more
    (revoked when it takes the queue over: at-least-once, as after any takeover)."""
    if not starts:
        yield
        return
    rows = [ended(r, REVOKED) for r in store.open_rows(group, queues=starts)]
    rows += [
        (group, RESET_OWNER, t, q, start - 1, None, new_handle(), now, None, TAKEN)
        for (t, q), start in sorted(starts.items())
    ]
    store.append_log(rows)
    yield

    def release() -> None:
        locks = store.read_locks(group)
        changes: list[tuple[Queue, LockEntry | None, LockEntry]] = [
            (q, entry, LockEntry(RESET_OWNER, 0, start, 0, start))
            for q, start in sorted(starts.items())
            if (entry := locks.get(q)) is not None and entry.owner != RESET_OWNER
        ]
        if changes:
            store.write_locks(group, changes)

    store.commit(release, what="queue_lock")


class PullStore(Protocol):
    """What the pull protocol reads and writes: deltamq/pull_engine.py through the broker's
    engine, deltamq/pull_files.py without one. Writes other than :meth:`write_locks` are
    committed by the store; :meth:`write_locks` runs inside :meth:`commit`."""

    config: BrokerConfig
    clock: Clock

    def group(self, name: str) -> GroupConfig | None: ...
    def group_names(self) -> list[str]: ...
    def listens(self, group: str) -> bool: ...
    def subscriptions(self, group: str) -> list[Subscription]: ...
    def topic_queues(self, topic: str) -> int | None: ...
    def commit(self, attempt: Callable[[], R], *, what: str) -> R: ...
    def named(self) -> AbstractContextManager[None]: ...
    def before_pull(self) -> None: ...
    def heartbeat(self, group: str, client: str, now: int) -> None: ...
    def leave(self, group: str, client: str) -> None: ...
    def live_clients(self, group: str, since: int) -> list[str]: ...
    def read_locks(self, group: str) -> dict[Queue, LockEntry | None]: ...
    def write_locks(self, group: str, changes: list[tuple[Queue, LockEntry | None, LockEntry]]) -> None: ...
    def ensure_lock_rows(self, group: str, queues: Sequence[Queue]) -> None: ...
    def heads(self, now: int) -> dict[Queue, int]: ...
    def positions(self, group: str, queues: Sequence[Queue]) -> dict[Queue, tuple[int, int]]: ...
    def handout_rows(
        self,
        group: str,
        cfg: GroupConfig,
        subs: Sequence[Subscription],
        ranges: Sequence[tuple[str, int, int, int]],
        now: int,
    ) -> pa.Table: ...
    def open_rows(
        self, group: str, *, queues: Iterable[Queue] = (), handles: Iterable[str] = ()
    ) -> list[LogRow]: ...
    def append_log(self, rows: list[LogRow]) -> None: ...
    def record_keys(self, group: str, cfg: GroupConfig, acked: list[dict[str, Any]], now: int) -> None: ...
    def nack(self, rows: list[LogRow], level: int) -> None: ...
