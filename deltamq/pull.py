"""Pull consumers: consumers outside the engine (docs/behaviour.md §6).

``consumer = ctx.pull_consumer(group, client_id)``; ``consumer.pull(n)`` returns
messages, each with a ``receipt_handle``; ``consumer.ack(handles)`` /
``consumer.nack(handles, delay_level=None)`` end them.

- **Liveness and rebalancing.** A client records itself in ``clients`` at its first pull
  or ack and again whenever a quarter of ``client_timeout_ms`` has passed. At every pull,
  per subscribed topic (its retry topic included), the group's live clients (seen within
  ``client_timeout_ms``) and the topic's queues are both sorted and the queues divided
  evenly (RocketMQ's rebalanceByTopic with AllocateMessageQueueAveragely): a client
  pulls only its share.
- **Access lock** (DeFiBus's ConsumeQueueAccessLockManager, ``queue_lock``). The owner
  writes its lock row when it takes the queue, when it reserves further offsets, when a
  quarter of ``lock_queue_timeout_ms`` has passed since its last write (its last access),
  and before it hands out from a reservation older than half of ``RESERVE_MS``. The row's
  delivered offset is the end of the range the owner reserved: a pull reserves up to the
  queue's head, at most ``WINDOW`` batches ahead (or what the client handed out in the
  last half of ``RESERVE_MS``), before it hands anything out, so pulls
  inside the reservation write no lock row. Other clients count a reservation for
  ``RESERVE_MS`` after the owner's last write, then what was handed out. The fence: a
  pull that ends with its reservation older than half of ``RESERVE_MS`` rewrites its lock
  rows by compare-and-set before returning, so a takeover racing it either misses or
  makes the pull revoke what it handed out from that queue (never both hold). Anyone
  else is refused while the owner holds the queue; each refused attempt compares the
  queue's delivered offset with the one last seen (unchanged → the no-change counter
  goes up; changed → saved, counter reset); the owner's writes never touch the counter.
  A non-owner takes the queue
  only when the owner timed out (``lock_queue_timeout_ms``) or everything delivered was
  acknowledged (the reservation is all handed out and acked) and the counter reached
  ``max_deliver_offset_no_change_times``; it then starts at the acknowledged offset. A
  client whose share no longer includes a queue it holds gives back what it reserved and
  did not hand out (the delivered offset drops to what it handed out), so the new
  assignee can take the queue once the old owner's messages are acked. Lock rows change
  by compare-and-set MERGE and are read back: of racing clients exactly one wins.
- **In flight: an append-only log** (``deliveries``). A pull appends, in one commit, an
  ``INFLIGHT`` row per message handed out and a ``PASSED`` row where its range ends in
  messages the group does not take (filtered out, or duplicates by key); an ack appends
  an ``ACKED`` row per handle, a nack ``NACKED``, the expiry ``EXPIRED``, a takeover
  ``REVOKED`` for the previous owner's messages in flight plus a ``TAKEN`` row where the
  new owner starts. No hot-path commit rewrites a file, so clients never conflict. Per
  queue, the acknowledged offset is the lowest offset still in flight (acks may come in
  any order) and the delivered offset the end of what was handed out; both are read from
  the log on top of ``offsets.next_offset`` / ``offsets.delivered_offset``, into which
  the tick's ``pull_expiry`` step folds the log (offsets first, then the rows below the
  acknowledged offset are deleted). A delivery not acked within the group's
  ``invisible_time_ms`` counts as RECONSUME_LATER (the ``pull_expiry`` step); a nack
  likewise, now: both take the push consumers' retry / DLQ path (``%RETRY%<group>`` with
  back-off, ``%DLQ%<group>`` at the maximum).
- **Crash safety.** Outputs first, positions last: the lock's reservation is written
  before messages are handed out, the deliveries and the new positions are one append,
  a send-back is stored before the delivery is marked ended, offsets are folded before
  the log rows are deleted. A pull killed after reserving hands its range out again (the
  owner resumes where the log says it handed out); killed after appending, its messages
  expire and take the retry path.

Delivery is at-least-once: a client killed between handing out and recording, a
takeover after the owner timed out, or an ack racing the expiry of the same delivery can
repeat messages (idempotent consumption and exactly-once sinks deal with that). One
client id is one puller: two threads pulling under one id share its queues.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import TypeVar

from deltamq import faults
from deltamq.config import GroupConfig, Subscription
from deltamq.constants import ACKED, INFLIGHT, PASSED, REVOKED, TAKEN
from deltamq.errors import ConfigError, UnknownGroup, first_line
from deltamq.message import StoredMessage, messages_of, validate_group_name
from deltamq.pull_log import (
    RESET_OWNER,
    LockEntry,
    LogRow,
    PullStore,
    as_dict,
    decide_lock,
    ended,
    new_handle,
    receipt_handles,
)
from deltamq.rebalance import assign

R = TypeVar("R")
Queue = tuple[str, int]
log = logging.getLogger(__name__)

WINDOW = 10
"""A pull reserves up to the queue's head, at most this many batches ahead, or what this
client handed out in the last half of ``RESERVE_MS`` if more (the reservation lasts about
that long before the owner writes its lock row again anyway)."""
SCAN_LIMIT = 20_000
"""Queue offsets one ``pull`` call examines at most for messages to hand out. A pull whose
offsets yield fewer messages than it may hand out (a tag or SQL92 filter, keys consumed
already, messages retention removed) examines the next ones at once, twice as many each
time, up to this many: an empty answer means none within that many offsets, as a
RocketMQ broker's filtered pull scans a bounded stretch of its consume queue."""
RESERVE_MS = 2_000
"""A reservation counts this long after the owner's last lock write; the owner writes its
lock row again before it hands out from a reservation older than half of it, and
confirms its lock by compare-and-set after a pull that ends past that age (the fence)."""


@dataclass(frozen=True)
class PulledMessage(StoredMessage):
    """A pulled message: ack or nack it by ``receipt_handle``."""

    receipt_handle: str = ""


_NOBODY = LockEntry("", 0, 0)


# --- the consumer ---------------------------------------------------------------------------
@dataclass
class _Held:
    """A queue whose lock this client holds, as this client last wrote or used it."""

    position: int  # the next offset to hand out
    reserved: int  # the lock row's delivered offset: the end of the reservation
    written: int  # ``now`` of this client's last write of the lock row (its last access)


@dataclass
class _Plan:
    start: int
    end: int
    reserved: int
    write: bool


class PullConsumer:
    """A pull client of one CLUSTERING group."""

    def __init__(self, store: PullStore, group: str, client_id: str) -> None:
        self.store = store
        self.config = store.config
        self.group = validate_group_name(group)
        self.client_id = validate_group_name(client_id, "client id")
        self._cfg = self._pullable("does not exist", "create it first")
        self._seen: int | None = None  # the last heartbeat this client committed
        self._held: dict[Queue, _Held] = {}
        self._sent: dict[str, tuple] = {}  # receipt handle → its INFLIGHT row (this client's)
        self._pending: list[LogRow] = []  # ACKED rows of ack(flush=False), not yet appended
        self._pending_handles: set[str] = set()
        self._pace: tuple[float, int] = (time.monotonic(), 0)  # (since, handed out since)
        self._topology: tuple[int, list[Queue], list[Subscription]] | None = None  # (read at, queues, subs)
        self._released_checked: int | None = None  # when an idle pull last read the lock rows

    def _pullable(self, missing: str, hint: str, created_ts: int | None = None) -> GroupConfig:
        """The group's configuration, read now; UnknownGroup or ConfigError when pull
        clients cannot consume it (gone, or created again since ``created_ts``: its log and
        locks are the new group's; BROADCASTING, a push listener's or a sink's)."""
        cfg = self.store.group(self.group)
        if cfg is None or (created_ts is not None and cfg.created_ts != created_ts):
            known = ", ".join(self.store.group_names()) or "none"
            raise UnknownGroup(f"consumer group {self.group!r} {missing} (groups: {known}); {hint}")
        if cfg.mode != "CLUSTERING":
            raise ConfigError(
                f"group {self.group!r} is {cfg.mode}; pull consumers share a CLUSTERING group's "
                "queues (a BROADCASTING group is consumed by push instances)"
            )
        if cfg.listener or self.store.listens(self.group):
            raise ConfigError(
                f"group {self.group!r} has a push listener; a queue is consumed by push or by pull "
                "clients, not both: create a separate group for pull clients"
            )
        if cfg.sink_table:
            raise ConfigError(
                f"group {self.group!r} is a sink into {cfg.sink_table}; create a separate group for "
                "pull clients"
            )
        return cfg

    # --- helpers ------------------------------------------------------------------------------
    def _now(self, now: int | None) -> int:
        return self.store.clock.now_ms() if now is None else int(now)

    def _due(self, now: int, since: int | None, interval_ms: int) -> bool:
        return since is None or now - since >= max(interval_ms // 4, 1) or now < since

    def _keep_alive(self, now: int) -> None:
        """A heartbeat when a quarter of ``client_timeout_ms`` has passed since the last
        one (pulls and acks call it): a busy client stays live without a commit a call."""
        if self._due(now, self._seen, self.config.client_timeout_ms):
            self.heartbeat(now)

    def heartbeat(self, now: int | None = None) -> None:
        """Record this client as alive now."""
        now = self._now(now)
        self.store.heartbeat(self.group, self.client_id, now)
        self._seen = now

    def close(self, now: int | None = None) -> None:
        """Leave the group now (instead of after the client timeout), giving back the
        offsets reserved and not handed out, so the queues can change hands at once. The
        lock rows given back carry ``now`` (the clock's by default) as their last access,
        as a pull's do."""
        now = self._now(now)
        self.flush()
        if any(h.reserved > h.position for h in self._held.values()):

            def attempt() -> None:
                locks = self.store.read_locks(self.group)
                self.store.write_locks(self.group, self._give_back(locks, set(self._held), now))

            self.store.commit(attempt, what="queue_lock")
        self._held.clear()
        self.store.leave(self.group, self.client_id)
        self._seen = None

    def assignment(self, now: int | None = None) -> list[Queue]:
        """The queues this client may pull now: per subscribed topic (as RocketMQ's
        rebalanceByTopic), its share of the topic's queues among the live clients."""
        subs = self.store.subscriptions(self.group)
        return assign(group_queues(subs, self.store.topic_queues), self._live(self._now(now)), self.client_id)

    def _live(self, now: int) -> list[str]:
        return self.store.live_clients(self.group, now - self.config.client_timeout_ms) + [self.client_id]

    def _queues(self, now: int) -> list[Queue]:
        """The group's queues, read again (with its subscriptions and its configuration)
        when a quarter of ``client_timeout_ms`` has passed: a new subscription or setting is
        seen within that time, and a group deleted, or made a sink or a push listener's
        since, stops this client (UnknownGroup, ConfigError) instead of taking its
        messages."""
        if self._topology is None or self._due(now, self._topology[0], self.config.client_timeout_ms):
            gone = "was deleted (or deleted and created again) since this client was created"
            self._cfg = self._pullable(gone, "stop this client", self._cfg.created_ts)
            subs = self.store.subscriptions(self.group)
            self._topology = (now, group_queues(subs, self.store.topic_queues), subs)
        return self._topology[1]

    def _subs(self, now: int) -> list[Subscription]:
        self._queues(now)
        assert self._topology is not None
        return self._topology[2]

    # --- pulling ------------------------------------------------------------------------------
    def pull(
        self, max_messages: int = 32, now: int | None = None, *, wait_ms: int = 0
    ) -> list[PulledMessage]:
        """Up to ``max_messages`` messages from this client's queues, each invisible to
        every other client until acked, nacked or ``invisible_time_ms`` has passed.
        ``wait_ms`` > 0 (a long poll, real clock only): when nothing is there, try again
        until something is or ``wait_ms`` has passed."""
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ConfigError(f"max_messages={max_messages!r} must be an integer >= 1")
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, int) or wait_ms < 0:
            raise ConfigError(f"wait_ms={wait_ms!r} must be an integer >= 0")
        deadline = time.monotonic() + wait_ms / 1000.0
        while True:
            with self.store.named():
                got = self._scan(max_messages, now)
            left = deadline - time.monotonic()
            if got or now is not None or left <= 0:
                return got
            time.sleep(min(left, _POLL_S))

    def _scan(self, budget: int, now: int | None) -> list[PulledMessage]:
        """Pulls until ``budget`` messages are handed out, or a pull's offsets yielded as
        many messages as it examined (nothing filtered out: the queues are at their
        heads), or :data:`SCAN_LIMIT` offsets were examined; each pull examines twice
        the offsets of the one before, at its own time (``now`` if given: its lock row
        and fence count the time the pulls before it took). A pull after the first that fails
        leaves the messages of those before it to the caller (they are in the log, in
        flight), with a warning."""
        got: list[PulledMessage] = []
        examined, scan, pulls = 0, budget, 0
        while True:
            try:
                out, seen = self._pull(budget - len(got), self._now(now), scan, first=pulls == 0)
            except Exception as e:
                if not got:
                    raise
                log.warning(
                    "pull of %s/%s: handing out what it has; the next pull failed: %s: %s",
                    self.group,
                    self.client_id,
                    type(e).__name__,
                    first_line(e),
                )
                break
            got += out
            examined += seen
            pulls += 1
            if len(got) >= budget or seen <= len(out) or examined >= SCAN_LIMIT:
                break
            scan = min(2 * scan, SCAN_LIMIT - examined)
        if pulls > 1:  # each pull's messages in order; together in the same order
            got.sort(key=lambda m: (m.topic, m.queue_id, m.queue_offset))
        return got

    def _pull(self, budget: int, now: int, scan: int, *, first: bool) -> tuple[list[PulledMessage], int]:
        """One pull: up to ``budget`` messages from at most ``scan`` offsets (at least
        ``budget``) of this client's queues; the messages and how many offsets it examined.
        ``first``: the first pull of a call (only it counts a refused lock request)."""
        started = time.monotonic()
        self.store.before_pull()
        queues = self._queues(now)  # the group read again when due: a deleted one stops here
        self._keep_alive(now)
        mine = assign(queues, self._live(now), self.client_id)
        held = self._held
        mine_set = set(mine)
        for q in [q for q, h in held.items() if q not in mine_set and h.reserved <= h.position]:
            del held[q]  # no longer ours to pull: taken up again only through the lock
        # the queue heads, only when what this client reserved does not fill the batch
        reserved = sum(held[q].reserved - held[q].position for q in mine if q in held)
        heads: dict[Queue, int] = {}
        if any(q not in held for q in mine) or reserved < scan:
            heads = self.store.heads(now)
        lock_needed = (
            any(q not in held for q in mine)
            or any(heads.get(q, 0) > held[q].reserved for q in mine)
            or any(self._stale(held[q], now) for q in mine)
            or any(h.reserved > h.position for q, h in held.items() if q not in mine_set)
        )
        if lock_needed:
            takes = self._lock(mine, now, heads, budget, scan=scan, count_refused=first)
        else:
            takes, left = {}, scan
            for q in mine:
                h = held[q]
                end = max(h.position, min(h.reserved, h.position + left))
                left -= end - h.position
                takes[q] = (h.position, end)
            if all(hi <= lo for lo, hi in takes.values()) and self._released(mine, now):
                # nothing to hand out, and a queue this client holds was released by an
                # offset reset (restart_queues): taken again at the new offset
                takes = self._lock(
                    mine, now, heads or self.store.heads(now), budget, scan=scan, count_refused=first
                )
        faults.point("pull.after_lock_commit")
        ranges = [(t, q, lo, hi) for (t, q), (lo, hi) in sorted(takes.items()) if hi > lo]
        prefix = f"{now & 0xFFFFFFFFFFFF:012x}{secrets.token_hex(5)}"  # the pull's handles
        handouts = self._read(ranges, now, prefix, now + self._cfg.invisible_time_ms)
        if len(handouts.rows) > budget:  # more than it may hand out: each queue ends before the rest
            handouts, takes, ranges = _first(handouts, budget, takes)
        examined = sum(hi - lo for _, _, lo, hi in ranges)
        log = self._pending + self._takeover_rows(now)  # acks waiting for this pull first
        log += handouts.rows + self._passed(handouts.rows, ranges, now)
        if log:
            self.store.append_log(log)
            self._acks_recorded()
        faults.point("pull.after_deliveries_commit")
        lost = self._fence(takes, now, time.monotonic() - started)
        rows, out = handouts.rows, handouts.messages
        if lost:  # revoked: what was handed out from a queue taken over meanwhile
            keep = [(row[2], row[3]) not in lost for row in rows]
            gone = [ended(r, REVOKED) for r, k in zip(rows, keep, strict=True) if not k]
            if gone:
                self.store.append_log(gone)
            rows = [r for r, k in zip(rows, keep, strict=True) if k]
            out = [m for m, k in zip(out, keep, strict=True) if k]
        for q, (_, end) in takes.items():
            if q in lost:
                held.pop(q, None)
            elif q in held:
                held[q].position = end
        since, handed = self._pace
        self._pace = (since, handed + len(handouts.rows))
        self._sent.update((row[6], row) for row in rows)
        self._forget_expired(now)
        if handouts.retold:  # a retried message shows its original topic: ordered by that
            out.sort(key=lambda m: (m.topic, m.queue_id, m.queue_offset))
        return out, examined

    def _passed(self, rows: list[LogRow], ranges: list[tuple[str, int, int, int]], now: int) -> list[LogRow]:
        """A ``PASSED`` log row for each of ``ranges`` that ends in messages not handed out
        (``rows``: the pull's ``INFLIGHT`` rows, in (topic, queue, offset) order)."""
        last: dict[Queue, int] = {}
        for row in rows:  # the last one of each queue wins
            last[(row[2], row[3])] = row[4]
        return [
            (self.group, self.client_id, topic, qid, hi - 1, None, new_handle(), now, None, PASSED)
            for topic, qid, _, hi in ranges
            if last.get((topic, qid), -1) < hi - 1
        ]

    def _fence(self, takes: dict[Queue, tuple[int, int]], now: int, elapsed_s: float) -> set[Queue]:
        """The queues of ``takes`` this client no longer holds, confirmed after handing out.

        Another client counts this client's reservation for ``RESERVE_MS`` after its last
        lock write (by its own clock: pull clients' clocks must agree within half of
        that); a pull that ends when the reservation is younger than half of that (and of
        ``lock_queue_timeout_ms``) needs no check. Otherwise the fence is a
        compare-and-set of each lock row, as this client last wrote it, to a new access
        time: a takeover that read the row before (and commits after) no longer matches,
        and a takeover that committed first makes this write miss. Either way one client
        holds the queue; what this one handed out from a lost queue is revoked by the
        caller."""
        young_ms = min(RESERVE_MS, self.config.lock_queue_timeout_ms) / 2
        age_ms = {q: now - h.written + elapsed_s * 1000.0 for q, h in self._held.items()}
        aged = [q for q, (lo, hi) in takes.items() if hi > lo and age_ms.get(q, 0) >= young_ms]
        if not aged:
            return set()
        stamps = {q: max(now, self._held[q].written + 1) for q in aged}

        def attempt() -> None:
            current = self.store.read_locks(self.group)
            changes: list[tuple[Queue, LockEntry | None, LockEntry]] = []
            for q in aged:
                got, h = current.get(q), self._held[q]
                if got is None or got.owner != self.client_id or got.last_access_ts != h.written:
                    continue  # taken over, or already stamped (a retry after a lost answer)
                changes.append((q, got, replace(got, last_access_ts=stamps[q])))
            faults.point("pull.before_fence_commit")
            self.store.write_locks(self.group, changes)

        self.store.commit(attempt, what="queue_lock")
        after = self.store.read_locks(self.group)
        lost = set()
        for q in aged:
            got = after.get(q) or _NOBODY
            if got.owner == self.client_id and got.last_access_ts == stamps[q]:
                self._held[q].written = stamps[q]
            else:
                lost.add(q)
        return lost

    def _recent_pace(self) -> int:
        """Messages this client hands out in half of ``RESERVE_MS`` at its pace since the
        previous call (real time: the reservation's owner rewrites it about that often);
        a reservation that size lasts until then. The client's pace over all its queues,
        used as each queue's bound: a queue it drains alone gets all of it."""
        since, handed = self._pace
        elapsed = time.monotonic() - since
        self._pace = (time.monotonic(), 0)
        return int(handed * (RESERVE_MS / 2000.0) / elapsed) if elapsed > 0 else 0

    def _stale(self, h: _Held, now: int) -> bool:
        """Whether the lock row must be written before ``h`` is used: a quarter of the lock
        timeout has passed since the last write, or offsets are reserved beyond what was
        handed out and half of ``RESERVE_MS`` has passed (another client counts a
        reservation older than ``RESERVE_MS`` as lapsed)."""
        if self._due(now, h.written, self.config.lock_queue_timeout_ms):
            return True
        return h.reserved > h.position and not 0 <= now - h.written < RESERVE_MS // 2

    def _released(self, mine: list[Queue], now: int) -> bool:
        """Whether a lock row of a queue this client holds names another owner now (an
        offset reset released it): read by a pull that has nothing to hand out, at most
        once per ``RESERVE_MS / 2`` (a busy client meets the change at its next lock write)."""
        if self._released_checked is not None and 0 <= now - self._released_checked < RESERVE_MS // 2:
            return False
        self._released_checked = now
        locks = self.store.read_locks(self.group)
        return any((locks.get(q) or _NOBODY).owner != self.client_id for q in mine if q in self._held)

    def _forget_expired(self, now: int) -> None:
        if len(self._sent) > 100_000:
            self._sent = {h: r for h, r in self._sent.items() if r[8] > now}

    def _lock(
        self,
        mine: list[Queue],
        now: int,
        heads: dict[Queue, int],
        budget: int,
        *,
        scan: int | None = None,
        count_refused: bool = True,
    ) -> dict[Queue, tuple[int, int]]:
        """Take, extend or refresh the access lock of ``mine`` (and give back what queues
        no longer assigned reserved), in one compare-and-set of the lock rows; returns
        {queue: (start, end)} of the ranges of ``scan`` offsets in all (``budget`` if None)
        to examine in each queue this client holds. A reservation grows to the queue's
        head, at most ``WINDOW`` batches ahead, or :meth:`_recent_pace`, or ``scan``, if
        more. The owner starts where it handed out last (from the log when this client has
        no memory of the queue: a range reserved by a pull killed before recording is
        handed out again); a new owner at the acknowledged offset. ``count_refused``: a
        refused request counts toward the owner's unchanged polls (once a ``pull`` call)."""
        me = self.client_id
        scan = budget if scan is None else scan
        window = max(max(budget, 1) * WINDOW, self._recent_pace(), scan)
        plans: dict[Queue, _Plan] = {}
        # queue -> (where this owner starts, whether an offset reset released it)
        taken: dict[Queue, tuple[int, bool]] = {}
        mine_set = set(mine)

        def attempt() -> None:
            plans.clear()
            taken.clear()
            locks = self.store.read_locks(self.group)
            unknown = [q for q in mine if q not in self._held or (locks.get(q) or _NOBODY).owner != me]
            derived = self.store.positions(self.group, unknown) if unknown else {}
            changes = []
            left = scan
            for q in mine:
                entry = locks.get(q)
                plan, change, taken_at = self._plan_queue(
                    entry, derived.get(q, (0, 0)), self._held.get(q), now, left, window, heads.get(q, 0)
                )
                if plan is None and not count_refused:
                    change = None  # refused again within one pull call: counted once
                if change is not None:
                    changes.append((q, entry, change))
                if plan is None:
                    continue
                if taken_at is not None:
                    taken[q] = (taken_at, entry is not None and entry.owner == RESET_OWNER)
                left -= plan.end - plan.start
                plans[q] = plan
            changes += self._give_back(locks, set(self._held) - mine_set, now)
            faults.point("pull.before_lock_commit")
            self.store.write_locks(self.group, changes)
            if any(p.write for p in plans.values()):
                self._drop_unconfirmed(plans, now)

        if any(q not in self._held for q in mine):
            existing = self.store.read_locks(self.group)
            if any(q not in existing for q in mine):
                self.store.ensure_lock_rows(self.group, mine)
        self.store.commit(attempt, what="queue_lock")
        for q in list(self._held):
            if q not in plans:
                del self._held[q]
        for q, p in plans.items():
            h = self._held.get(q)
            self._held[q] = _Held(p.start, p.reserved, now if p.write or h is None else h.written)
        self._taken = {q: s for q, s in taken.items() if q in plans}
        return {q: (p.start, p.end) for q, p in plans.items()}

    def _plan_queue(
        self,
        entry: LockEntry | None,
        derived: tuple[int, int],
        h: _Held | None,
        now: int,
        left: int,
        window: int,
        head: int,
    ) -> tuple[_Plan | None, LockEntry | None, int | None]:
        """One queue of :meth:`_lock`: (the range to hand out, or None when refused; the
        lock row to write, if any; the acknowledged offset it starts from when this
        client takes it over from another owner). ``derived``: its (acknowledged,
        delivered) offsets from the log; ``left``: messages the pull may still take."""
        cfg = self.config
        me = self.client_id
        taken_at = None
        if h is not None and entry is not None and entry.owner == me:
            verdict, start = "held", h.position
            reserved = max(start, entry.delivered_offset if entry.delivered_offset is not None else start)
            count = entry.no_change_count
        else:
            acked, delivered = derived
            seen = delivered  # an owner's reservation counts while it is recent
            if entry is not None and entry.delivered_offset is not None:
                if entry.owner == me or now - entry.last_access_ts < RESERVE_MS:
                    seen = max(delivered, entry.delivered_offset)
            verdict, new = decide_lock(
                entry,
                me,
                now,
                seen,
                acked,
                timeout_ms=cfg.lock_queue_timeout_ms,
                max_no_change=cfg.max_deliver_offset_no_change_times,
            )
            if verdict == "refused":
                return None, new, None
            if verdict == "acquired":
                start = reserved = acked
                if entry is not None and entry.owner == RESET_OWNER and entry.delivered_offset is not None:
                    # released by an offset reset: its offset, whatever was handed out since
                    start = reserved = entry.delivered_offset
                if entry is not None:
                    taken_at = start
            else:  # the owner by the table, new to this object (restarted)
                start, reserved = delivered, max(seen, delivered)
            count = new.no_change_count
        end = min(start + max(left, 0), reserved)
        grown = reserved
        if start + left > reserved and head > reserved:
            grown = min(head, start + window)
            end = min(start + left, grown)
        end = max(end, start)
        write = verdict != "held" or grown != reserved or h is None or self._stale(h, now)
        change = LockEntry(me, now, grown, count, grown) if write else None
        return _Plan(start, end, grown, write), change, taken_at

    def _drop_unconfirmed(self, plans: dict[Queue, _Plan], now: int) -> None:
        """Read the lock rows back: a queue whose row this pass wrote but does not hold
        as written (another client's compare-and-set won) is dropped from ``plans``."""
        after = self.store.read_locks(self.group)
        for q, p in list(plans.items()):
            got = after.get(q)
            if p.write and not (
                got is not None
                and got.owner == self.client_id
                and got.last_access_ts == now
                and got.delivered_offset == p.reserved
            ):
                del plans[q]

    def _give_back(
        self, locks: dict[Queue, LockEntry | None], queues: set[Queue], now: int
    ) -> list[tuple[Queue, LockEntry | None, LockEntry]]:
        """Lock changes that shrink this client's reservations of ``queues`` to what it
        handed out (queues it no longer pulls: the next owner may then take them once
        everything is acked)."""
        out: list[tuple[Queue, LockEntry | None, LockEntry]] = []
        for q in sorted(queues):
            h, entry = self._held.get(q), locks.get(q)
            if h is None or entry is None or entry.owner != self.client_id:
                continue
            if entry.delivered_offset is not None and entry.delivered_offset > h.position:
                back = replace(
                    entry, last_access_ts=now, last_delivered_offset=h.position, delivered_offset=h.position
                )
                out.append((q, entry, back))
        return out

    # set per pull by _lock: queue -> (where this owner starts, whether a reset released it)
    _taken: dict[Queue, tuple[int, bool]] = {}  # noqa: RUF012

    def _takeover_rows(self, now: int) -> list[tuple]:
        """Log rows of the queues just taken over: the previous owners' messages in flight
        are revoked (handed out again from the acknowledged offset) and a ``TAKEN`` row
        marks where this owner starts (rows delivered before it no longer count)."""
        taken, self._taken = self._taken, {}
        if not taken:
            return []
        rows = [
            ended(r, REVOKED)
            for r in self.store.open_rows(self.group, queues=taken)
            if r[1] != self.client_id or taken[(r[2], r[3])][1]  # after a reset, its own too
        ]
        for (t, q), (start, _) in sorted(taken.items()):
            rows.append((self.group, self.client_id, t, q, start - 1, None, new_handle(), now, None, TAKEN))
        return rows

    def _read(
        self, ranges: list[tuple[str, int, int, int]], now: int, prefix: str, invisible: int
    ) -> _Handouts:
        """The messages of ``ranges`` the group takes (deltamq/pull_reads.py), in (topic,
        queue, offset) order, each with a receipt handle: ``prefix`` and the message's
        place in the batch, so the handles of one pull form one range of the log; and
        their ``INFLIGHT`` log rows, built a column at a time."""
        if not ranges:
            return _Handouts([], [], False)
        rows = self.store.handout_rows(self.group, self._cfg, self._subs(now), ranges, now)
        rows = rows.sort_by([(c, "ascending") for c in ("topic", "queue_id", "queue_offset")])
        n = rows.num_rows
        handles = [f"{prefix}{i:06x}" for i in range(n)]
        messages = messages_of(rows, PulledMessage, receipt_handle=handles)
        topics = rows.column("topic").to_pylist()
        log = list(
            zip(
                repeat(self.group, n),
                repeat(self.client_id, n),
                topics,
                rows.column("queue_id").to_pylist(),
                rows.column("queue_offset").fill_null(0).to_pylist(),
                rows.column("msg_id").to_pylist(),
                handles,
                repeat(now, n),
                repeat(invisible, n),
                repeat(INFLIGHT, n),
                strict=True,
            )
        )
        retold = any(m.topic != t for m, t in zip(messages, topics, strict=True))
        return _Handouts(messages, log, retold)

    # --- acknowledging ------------------------------------------------------------------------
    def ack(self, handles: Iterable[str], now: int | None = None, *, flush: bool = True) -> int:
        """Acknowledge messages (any order). Returns how many handles were in flight; a
        handle that expired, was nacked or revoked by a takeover is not counted.

        ``flush=False`` records the acks with this client's next pull, ``flush()`` or
        ``close()`` instead of in a commit of their own (one commit a pull + ack cycle
        instead of two). Until then they are not stored: a client that dies first has
        those messages handed out again after the invisible time, and another client
        cannot take their queue over. Groups with a de-duplication key always flush."""
        with self.store.named():
            return self._ack(handles, now, flush or bool(self._cfg.dedup_key))

    def flush(self) -> None:
        """Store the acks that ``ack(..., flush=False)`` kept for the next pull."""
        if self._pending:
            with self.store.named():
                self.store.append_log(list(self._pending))
            self._acks_recorded()

    def _acks_recorded(self) -> None:
        self._pending, self._pending_handles = [], set()

    def _ack(self, handles: Iterable[str], now: int | None, flush: bool) -> int:
        now = self._now(now)
        handles = receipt_handles(handles)
        if not handles:
            return 0
        self._queues(now)  # the group read again when due: a deleted one stops here
        self._keep_alive(now)
        found = self._in_flight([h for h in handles if h not in self._pending_handles], now)
        acked = [ended(r, ACKED) for r in found]
        if self._cfg.dedup_key and found:
            # the keys before the acks, as deliver records them before its offsets: a client
            # killed in between leaves the message in flight with its key consumed, so the
            # copy handed out again is acknowledged as a duplicate, not processed twice
            self.store.record_keys(self.group, self._cfg, [as_dict(r) for r in found], now)
        if not flush:
            self._pending += acked
            self._pending_handles.update(r[6] for r in acked)
        elif acked or self._pending:
            self.store.append_log(self._pending + acked)
            self._acks_recorded()
        for h in handles:
            self._sent.pop(h, None)
        return len(found)

    def _in_flight(self, handles: list[str], now: int) -> list[tuple]:
        """The INFLIGHT rows of ``handles`` that are still in flight. This client's own
        handles need no read while they are certainly in flight: not past their invisible
        time, and the queue's lock written by this client recently enough that no other
        client can have taken it (a takeover by the no-change rule needs everything acked,
        one by timeout a silence of ``lock_queue_timeout_ms``)."""
        sure, unsure = [], []
        for h in handles:
            row = self._sent.get(h)
            held = self._held.get((row[2], row[3])) if row else None
            if (
                row is not None
                and held is not None
                and now < row[8]
                and 0 <= now - held.written < self.config.lock_queue_timeout_ms // 2
            ):
                sure.append(row)
            else:
                unsure.append(h)
        if unsure:
            sure += self.store.open_rows(self.group, handles=unsure)
        return sure

    def nack(self, handles: Iterable[str], delay_level: int | None = None, now: int | None = None) -> int:
        """Give messages back: each is retried through ``%RETRY%<group>`` (level
        ``delay_level``, default 3 + retries; < 0: straight to ``%DLQ%<group>``)."""
        with self.store.named():
            return self._nack(handles, delay_level, now)

    def _nack(self, handles: Iterable[str], delay_level: int | None, now: int | None) -> int:
        now = self._now(now)
        handles = receipt_handles(handles)
        if not handles:
            return 0
        if delay_level is not None and (isinstance(delay_level, bool) or not isinstance(delay_level, int)):
            raise ConfigError(f"delay_level={delay_level!r} must be an integer or None")
        self._queues(now)  # the group read again when due: a deleted one stops here
        self._keep_alive(now)
        found = self._in_flight([h for h in handles if h not in self._pending_handles], now)
        self.store.nack(found, delay_level or 0)
        for h in handles:
            self._sent.pop(h, None)
        return len(found)


_POLL_S = 0.05


@dataclass(frozen=True)
class _Handouts:
    """One pull's messages and their ``INFLIGHT`` log rows, in the same order."""

    messages: list[PulledMessage]
    rows: list[LogRow]
    retold: bool  # some message shows another topic than the one it is stored in (a retry)


def _first(
    handouts: _Handouts, budget: int, takes: dict[Queue, tuple[int, int]]
) -> tuple[_Handouts, dict[Queue, tuple[int, int]], list[tuple[str, int, int, int]]]:
    """The first ``budget`` of ``handouts`` (in log order: topic, queue, offset), and the
    takes and ranges cut to match: a queue ends at its first message left out, which the
    next pull hands out (the offsets before it are examined: passed over)."""
    rows = handouts.rows
    cut: dict[Queue, int] = {}
    for row in rows[budget:]:
        cut.setdefault((row[2], row[3]), row[4])
    kept = _Handouts(handouts.messages[:budget], rows[:budget], handouts.retold)
    takes = {q: (lo, min(hi, cut.get(q, hi))) for q, (lo, hi) in takes.items()}
    ranges = [(t, q, lo, hi) for (t, q), (lo, hi) in sorted(takes.items()) if hi > lo]
    return kept, takes, ranges


def group_queues(subs: Sequence[Subscription], topic_queues: Callable[[str], int | None]) -> list[Queue]:
    """Every queue of every topic of ``subs`` (a group's retry topic is among them);
    ``topic_queues`` gives a topic's queue count, None for a deleted topic."""
    out = []
    for sub in subs:
        n = topic_queues(sub.topic)
        out += [(sub.topic, q) for q in range(n or 0)]
    return sorted(out)
