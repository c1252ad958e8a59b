"""Job leases: one holder per job kind at a time, with epoch fencing.

A lease row per job kind (``leases`` table) names its holder, an epoch that grows at
every change of holder, and a wall-clock expiry. Taking a lease is a compare-and-set
``MERGE`` (matched only while the row still has the holder, epoch and expiry that were
read: a renewal keeps the epoch, so the expiry is what tells a renewed row from the one a
taker saw lapse),
verified by reading the row back: of two processes racing, exactly one sees itself.
A holder renews only when less than half its time is left, so an idle tick commits
nothing here. Leases use real clocks, never the broker's (possibly fake) clock.

Clocks of different machines disagree; leases stay exclusive while they differ by less
than the TTL (docs/reliability.md, "Skewed clocks"):

- The holder counts its lease on its own monotonic clock, from the moment *before* it
  read the row to take or renew it, for ``ttl_ms``; past that :meth:`Leases.check`
  fails even if the row still names it. The row's ``expires_at`` (holder's wall clock)
  is for people and for other holders' first guess only.
- Another holder takes a lease over only when it is released, or when its wall clock
  is past ``expires_at`` by one more TTL (the skew allowance), or when it has watched
  the row stay unchanged for one TTL on its own monotonic clock (a waiting runner does
  not depend on anyone's wall clock at all). The TTL is the *holder's*, recorded in the
  row (``ttl_ms``): runners configured with different TTLs stay exclusive.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc

from deltamq import file_reads
from deltamq.clock import ms_to_iso
from deltamq.errors import LeaseHeld, LeaseLost
from deltamq.tables.sqltext import sql_in, sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.config import BrokerConfig, CommitPolicy
    from deltamq.tables.warehouse import Warehouse

JOB_KINDS = ("dispatch", "promote", "deliver", "sink", "check_transactions", "retain")


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def new_holder_id() -> str:
    """``DELTAMQ_RUNNER_ID`` if set (a restarted runner keeps its leases), else
    host:pid:random."""
    return os.environ.get("DELTAMQ_RUNNER_ID") or (
        f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    )


def describe_holder(holder: str) -> str:
    """``holder`` for an error, with what this process can check about it: a holder id of
    this host (``host:pid:random``, :func:`new_holder_id`) says whether that process still
    runs (``os.kill(pid, 0)``); of another host, or a ``DELTAMQ_RUNNER_ID``, nothing more."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return holder
    pid = int(pid_text)
    if pid == os.getpid():
        return f"{holder} (this process)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"{holder} (process {pid} on this host has exited; the lease lapses at its expiry)"
    except OSError:  # PermissionError: it exists, another user's
        pass
    return f"{holder} (process {pid} on this host is running)"


_Change = tuple[str, "Lease | None", int, int]
"""(job, the lease as read, the new epoch, the last ``now`` to keep)."""


@dataclass(frozen=True)
class Lease:
    job: str
    holder: str
    epoch: int
    expires_at: int
    last_now: int | None
    ttl_ms: int | None = None  # the holder's lease time (None: a row of schema version 4)

    def allowance(self, own_ttl_ms: int) -> int:
        """How long past its expiry (and how long unchanged) this lease still counts: the
        holder's TTL, or ours for a row that does not record it."""
        return self.ttl_ms if self.ttl_ms is not None else own_ttl_ms


@dataclass(frozen=True)
class LeaseTerms:
    """What taking a lease needs from the broker's configuration, passed with each call:
    how long a lease lasts, and how its compare-and-set commit is retried."""

    ttl_ms: int
    commits: CommitPolicy

    @classmethod
    def of(cls, config: BrokerConfig) -> LeaseTerms:
        return cls(config.lease_ttl_ms, config.commit_policy)


class Leases:
    """Acquire, renew, check and release job leases of one warehouse, as one holder."""

    def __init__(
        self,
        warehouse: Warehouse,
        holder: str | None = None,
        wall: Callable[[], int] = wall_ms,
        mono: Callable[[], int] = mono_ms,
    ) -> None:
        self.wh = warehouse
        self.holder = holder or new_holder_id()
        self.wall = wall
        self.mono = mono
        self.held: dict[str, Lease] = {}
        self.valid_until: dict[str, int] = {}  # job → the end of our lease, monotonic ms
        self._watched: dict[str, tuple[Lease, int]] = {}  # job → (another's row, first seen)
        # job → {(epoch, expires_at) our compare-and-set wrote: the end of that lease,
        # monotonic}; kept until the row is read back, so a commit whose answer was lost
        # is known as ours when it is read later
        self._written: dict[str, dict[tuple[int, int], int]] = {}

    def _lapsed(self, cur: Lease, wall_now: int, mono_now: int, ttl_ms: int) -> bool:
        """Whether another holder's lease ``cur`` may be taken over: released, past its
        expiry by one more TTL on this wall clock, or unchanged for a TTL on this
        monotonic clock."""
        seen = self._watched.get(cur.job)
        if seen is None or seen[0] != cur:
            self._watched[cur.job] = seen = (cur, mono_now)
        allowance = cur.allowance(ttl_ms)
        return cur.expires_at + allowance < wall_now or mono_now - seen[1] >= allowance

    def _read(self, jobs: Sequence[str]) -> dict[str, Lease]:
        """The lease rows of ``jobs`` as committed now: from the table's files (its kept
        snapshot brought up to date, deltamq/file_reads.py), else through the engine."""
        columns = ["job", "holder", "epoch", "expires_at", "last_now", "ttl_ms"]
        found = file_reads.rows(self.wh, "leases", columns, pc.field("job").isin(list(jobs)))
        rows: list[Any] = (
            found.to_pylist()
            if found is not None
            else self.wh.engine.rows(
                f"SELECT {', '.join(columns)} FROM {self.wh.ref('leases')} WHERE job IN {sql_in(jobs)}"
            )
        )
        out: dict[str, Lease] = {}
        for r in sorted(rows, key=lambda r: (-(r["epoch"] or 0), r["holder"] or "")):
            out.setdefault(
                r["job"],
                Lease(
                    r["job"],
                    r["holder"] or "",
                    r["epoch"] or 0,
                    r["expires_at"] or 0,
                    r["last_now"],
                    r["ttl_ms"],
                ),
            )
        return out

    def acquire(
        self, jobs: Sequence[str], terms: LeaseTerms, *, last_now: int | None = None
    ) -> dict[str, Lease]:
        """Take (or renew) the leases of ``jobs`` for ``terms.ttl_ms``.

        Raises LeaseHeld naming the holder if another live holder has any of them (then
        nothing is written), or if another took one between the read and the commit (each
        row's compare-and-set holds alone: those that held are kept and recorded as held).
        Commits only when a lease is new, expired, or past half its time.
        """
        jobs = list(dict.fromkeys(jobs))

        def attempt() -> dict[str, Lease]:
            started = self.mono()  # our lease counts from before we read the row
            now = self.wall()
            current = self._adopt(self._read(jobs))
            read_at = self.mono()  # another's row is watched from after we read it
            # another holder's rows; and a row under our own name at an epoch other than the
            # one this object holds: a process sharing our name took it over, and this one,
            # fenced, waits for it like for any holder (taking it straight back would fence
            # that one mid-pass, and so on, every tick)
            others = [
                c
                for c in (current.get(job) for job in jobs)
                if c
                and c.holder
                and c.expires_at > 0
                and (c.holder != self.holder or (c.job in self.held and self.held[c.job].epoch != c.epoch))
            ]
            held = [c for c in others if not self._lapsed(c, now, read_at, terms.ttl_ms)]
            if held:
                first = held[0]
                raise LeaseHeld(
                    f"job {first.job!r} is held by {describe_holder(first.holder)} until "
                    f"{ms_to_iso(first.expires_at)} UTC (epoch {first.epoch}), taken over "
                    f"{first.allowance(terms.ttl_ms)} ms after that (the holder's TTL, the "
                    "allowance for clock skew), or once unchanged that long; "
                    "wait for it or stop that runner"
                )
            changes: list[_Change] = []
            for job in jobs:
                cur = current.get(job)
                # ours: live, under our name, at the epoch this object took it. A row under
                # our name that this object does not hold (a restarted runner with the same
                # DELTAMQ_RUNNER_ID, or a second process sharing it) is taken at once, at
                # the next epoch: the other process, if it still runs, is fenced by it
                kept = self.held.get(job)
                mine = (
                    cur is not None
                    and cur.holder == self.holder
                    and cur.expires_at > now
                    and kept is not None
                    and kept.epoch == cur.epoch
                )
                if mine and self._left(job, cur, started) > terms.ttl_ms // 2:
                    continue  # more than half its time left: no commit
                epoch = cur.epoch if cur is not None and mine else (cur.epoch if cur else 0) + 1
                keep_now = max(x for x in (last_now, cur.last_now if cur else None, -1) if x is not None)
                changes.append((job, cur, epoch, keep_now))
            if changes:
                self._cas(changes, now, terms.ttl_ms, started)
                current = self._read(jobs)
                self._confirm(changes, current, now + terms.ttl_ms, started + terms.ttl_ms)
            self.held.update({j: current[j] for j in jobs})
            return {j: current[j] for j in jobs}

        return self.wh.commit(attempt, what="leases", policy=terms.commits)

    def _confirm(self, changes: list[_Change], current: dict[str, Lease], expires: int, until: int) -> None:
        """Record as held each row of ``changes`` that ``current`` (read after the
        compare-and-set) holds as we wrote it, valid until ``until`` (monotonic); raise
        LeaseHeld naming the first that is not (each row's compare-and-set holds or not
        alone: the others are still recorded)."""
        lost = []
        for job, cur, epoch, _ in changes:
            got = current.get(job)
            # ours only as written (the expiry too): a process sharing our name that took
            # the row at the same epoch first is not us
            if got is None or (got.holder, got.epoch, got.expires_at) != (self.holder, epoch, expires):
                renewed = got is not None and cur is not None and got.holder == cur.holder
                how = "renewed by its holder" if renewed else "taken by"
                if got is not None and got.holder == self.holder:
                    how = "taken by another process under this runner's name,"
                lost.append(f"job {job!r} was {how} {got.holder if got else '?'} while acquiring")
                continue
            self.valid_until[job] = until
            self.held[job] = got  # what it holds now, even when another row was lost
            self._written.pop(job, None)
        if lost:
            raise LeaseHeld(lost[0])

    def _left(self, job: str, row: Lease | None, mono_now: int) -> int:
        """How long our lease of ``job`` lasts still, by our monotonic clock (0 if the row
        is not the one we wrote)."""
        mine = self.held.get(job)
        if row is None or mine is None or (row.holder, row.epoch) != (mine.holder, mine.epoch):
            return 0
        return self.valid_until.get(job, mono_now) - mono_now

    def _adopt(self, current: dict[str, Lease]) -> dict[str, Lease]:
        """Take as held the rows of ``current`` that this object's own compare-and-set
        wrote though it never read them back (the store failed after the commit, and the
        attempt was retried or the call failed): without this, a lease renewed at the next
        epoch that way looked like another process's under our name, and fenced us."""
        for job, row in current.items():
            until = self._written.get(job, {}).get((row.epoch, row.expires_at))
            if until is not None and row.holder == self.holder:
                self.held[job] = row
                self.valid_until[job] = until
                del self._written[job]
        return current

    def _cas(self, changes: list[_Change], now: int, ttl_ms: int, started: int) -> None:
        selects = []
        for job, cur, epoch, keep_now in changes:
            self._written.setdefault(job, {})[(epoch, now + ttl_ms)] = started + ttl_ms
            selects.append(
                f"SELECT {sql_str(job)} AS job, {sql_str(self.holder)} AS holder, "
                f"{sql_long(epoch)} AS epoch, "
                f"{sql_long(now + ttl_ms)} AS expires_at, {sql_long(now)} AS acquired_at, "
                f"{sql_long(keep_now if keep_now >= 0 else None)} AS last_now, "
                f"{sql_long(ttl_ms)} AS ttl_ms, "
                f"{sql_str(cur.holder if cur else None)} AS old_holder, "
                f"{sql_long(cur.epoch if cur else None)} AS old_epoch, "
                f"{sql_long(cur.expires_at if cur else None)} AS old_expires"
            )
        self.wh.engine.execute(
            f"MERGE INTO {self.wh.ref('leases')} t USING ({' UNION ALL '.join(selects)}) s "
            "ON t.job = s.job "
            "WHEN MATCHED AND t.holder <=> s.old_holder AND t.epoch <=> s.old_epoch "
            "AND coalesce(t.expires_at, 0) <=> s.old_expires THEN UPDATE SET "
            "t.holder = s.holder, t.epoch = s.epoch, t.expires_at = s.expires_at, "
            "t.acquired_at = CASE WHEN t.holder <=> s.holder THEN t.acquired_at ELSE s.acquired_at END, "
            "t.last_now = s.last_now, t.ttl_ms = s.ttl_ms "
            "WHEN NOT MATCHED THEN INSERT (job, holder, epoch, expires_at, acquired_at, last_now, ttl_ms) "
            "VALUES (s.job, s.holder, s.epoch, s.expires_at, s.acquired_at, s.last_now, s.ttl_ms)"
        )

    def renewal_due(self, jobs: Sequence[str], terms: LeaseTerms) -> bool:
        """Whether any of ``jobs`` has half its time or less left (or is not held), by
        what this holder last saw: no read."""
        now = self.mono()
        return any(self._left(j, self.held.get(j), now) <= terms.ttl_ms // 2 for j in jobs)

    def renew_due(self, jobs: Sequence[str], terms: LeaseTerms) -> None:
        """Renew ``jobs`` if any has half its time or less left (by what this holder last
        saw: no read otherwise). Called between jobs, so a long tick does not run a later
        job on a lease that expires under it. The other leases this holder has that are
        due too are renewed in the same commit (leases taken together fall due together:
        one compare-and-set each cost a tick on Apache Spark ~0.8 s per job); if one of
        them is no longer ours, ``jobs`` are renewed again on their own and that job finds
        out at its own step."""
        if not self.renewal_due(jobs, terms):
            return
        others = [j for j in self.held if j not in jobs and self.renewal_due([j], terms)]
        if others:
            with suppress(LeaseHeld):  # one of them is not ours: renewed on their own below
                self.acquire([*jobs, *others], terms)
                return
        try:
            self.acquire(jobs, terms)
        except LeaseHeld as e:  # taken over while this tick ran: fenced, as check() would
            raise LeaseLost(f"{e}; this runner ({self.holder}) stops writing") from e

    def check(self, jobs: Sequence[str]) -> None:
        """Raise LeaseLost if any of ``jobs`` is no longer ours at the epoch we took it
        (a stale holder must not write): call before committing progress."""
        current = self._adopt(self._read(list(jobs)))
        now = self.mono()
        for job in jobs:
            mine = self.held.get(job)
            got = current.get(job)
            if mine is None or got is None or got.holder != self.holder or got.epoch != mine.epoch:
                raise LeaseLost(
                    f"lease of job {job!r} is now held by {got.holder if got else 'nobody'} "
                    f"(epoch {got.epoch if got else '?'}); this runner ({self.holder}) stops writing"
                )
            if self._left(job, got, now) <= 0:
                raise LeaseLost(
                    f"lease of job {job!r} ran out by this runner's clock (taken or renewed "
                    f"{now - self.valid_until.get(job, now)} ms too long ago); renew before writing"
                )

    def release(self, policy: CommitPolicy, jobs: Sequence[str] | None = None) -> None:
        """Give up leases (expiry set to 0, epoch kept so a stale copy stays fenced)."""
        jobs = list(jobs or {*self.held, *self._written})
        if not jobs:
            return
        if any(j in self._written for j in jobs):
            self._adopt(self._read(jobs))  # a row written though its answer was lost is ours
        # only at the epoch this object holds: a process sharing our name that took a row
        # over since keeps it
        ours = " OR ".join(
            f"(job = {sql_str(j)} AND epoch = {int(self.held[j].epoch)})" for j in jobs if j in self.held
        )
        if ours:
            self.wh.commit(
                lambda: self.wh.engine.execute(
                    f"UPDATE {self.wh.ref('leases')} SET expires_at = 0 "
                    f"WHERE holder = {sql_str(self.holder)} AND ({ours})"
                ),
                what="leases",
                policy=policy,
            )
        for j in jobs:
            self.held.pop(j, None)
            self.valid_until.pop(j, None)
            self._written.pop(j, None)
