"""Fault injection at scale: a mixed workload, ticks SIGKILLed anywhere, checked after
every kill. Used by tests/test_faults.py (the default run) and bench/reliability.py
(hundreds of kills, figures in docs/reliability.md).

Each round the parent process sends normal, delayed, timer, failing, orderly and
transactional messages, pulls and acks with a pull client, then runs ``deltamq tick`` in
a subprocess and kills it: at a named crash point (before or after a commit, the n-th
time it is reached) or after a random time. A tick is then run again to the end (same
runner id, so it keeps the dead one's leases) and everything is checked:

- dispatch conservation: every stored message indexed exactly once, offsets dense and
  never used twice per (topic, queue);
- no copy twice: one row per (topic, message, reconsume count) outside the hold
  topics, so no promoted delayed message and no retry was written twice;
- the per-group accounting: every message of every group in exactly one state.

At the end the clock runs on until every delay, retry and check-back is due, and every
message must be consumed by every group that subscribes to it (none lost), each
committed transaction visible once and each rolled-back one never.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from deltamq import Broker, Message
from deltamq.constants import (
    DLQ_PREFIX,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Prop,
    TxState,
)
from deltamq.dq.accounting import account
from deltamq.dq.conservation import check_dispatch
from deltamq.orchestration.tick import TickRunner
from support.crash import RUNNER_ID, run_job

# Crash points a tick of this workload reaches (retain's and pull expiry's only now and
# then: those rounds end without a kill, and the random-time kills cover the rest).
POINTS = [
    "dispatch.before_index_commit",
    "dispatch.after_index_commit",
    "dispatch.after_progress_commit",
    "promote.before_output_commit",
    "promote.after_output_commit",
    "promote.after_index_commit",
    "promote.after_progress_commit",
    "deliver.after_attempt_commit",
    "deliver.after_listener",
    "deliver.after_sendback_commit",
    "deliver.after_offsets_commit",
    "check.after_start_commit",
    "check.before_output_commit",
    "check.after_output_commit",
    "check.after_progress_commit",
    "pull_expiry.after_sendback_commit",
    "pull_expiry.after_offsets_commit",
    "retain.after_index_commit",
]
HOLD_TOPICS = (SCHEDULE_TOPIC, TIMER_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC)
GROUPS = {"push": "orders", "seq": "fifo", "puller": "orders"}


@dataclass
class Figures:
    rounds: int = 0
    kills: int = 0
    kills_at_points: int = 0
    kills_at_random: int = 0
    messages: int = 0
    transactions: int = 0
    consumed: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    duplicate_copies: int = 0
    duplicate_offsets: int = 0
    unaccounted: int = 0
    conflicts_retried: int = 0
    seconds: float = 0.0


class FaultLoad:
    def __init__(self, broker: Broker, clock, warehouse: Path, seed: int = 1) -> None:
        self.broker, self.clock, self.wh = broker, clock, Path(warehouse)
        self.rng = random.Random(seed)
        self.runner = TickRunner(broker.context, holder=RUNNER_ID)
        self.sent: dict[str, set[str]] = {"orders": set(), "fifo": set()}  # UNIQ_KEY per topic
        self.committed: set[str] = set()
        self.rolled_back: set[str] = set()
        self.figures = Figures()
        self.allowed = dict.fromkeys(GROUPS, 0)  # per group: messages that may exist beyond those sent
        self.started = time.monotonic()
        self.puller = None

    def setup(self) -> None:
        b = self.broker
        b.create_topic("orders", queues=4)
        b.create_topic("fifo", queues=2, ordered=True)
        b.create_group("push", "support.listeners:fail_odd_once", consume_from="FIRST_OFFSET")
        b.subscribe("push", "orders")
        b.create_group(
            "seq", "support.listeners:suspend_marked_once", orderly=True, consume_from="FIRST_OFFSET"
        )
        b.subscribe("seq", "fifo")
        b.create_group("puller", consume_from="FIRST_OFFSET", invisible_time_ms=30_000)
        b.subscribe("puller", "orders")
        b.producer("shop", check_listener="support.listeners:check_by_prefix")
        self.puller = b.pull_consumer("puller", "c1")

    # --- one round ----------------------------------------------------------------------------
    def produce(self, r: int) -> None:
        p = self.broker.producer("p")
        batch = [Message("orders", f"r{r}n{i}") for i in range(8)]  # odd ones fail once
        batch += [Message("orders", f"r{r}d{i}", delay_level=1 + i % 3) for i in range(4)]
        batch += [Message("orders", f"r{r}t{i}", delay=timedelta(seconds=7 + i)) for i in range(2)]
        ids = p.send_batch(batch)
        fifo = [Message("fifo", f"r{r}o{i}" + ("-suspend" * (i == 1 and r % 4 == 0))) for i in range(6)]
        ids_fifo = p.send_batch(fifo, queue_keys=[f"k{i % 3}" for i in range(6)])
        shop = self.broker.producer("shop")
        for i in range(2):
            state = "COMMIT" if i == 0 else "ROLLBACK"
            h = shop.send_in_transaction(Message("orders", f"{state}:r{r}x{i}"), lambda m, a: TxState.UNKNOWN)
            (self.committed if i == 0 else self.rolled_back).add(h.handle.tran_id)
        self.sent["orders"] |= set(ids)
        self.sent["fifo"] |= set(ids_fifo)
        self.figures.messages += len(ids) + len(ids_fifo) + 2
        self.figures.transactions += 2

    def restart(self) -> None:
        """The runner started again, as a new process under the same DELTAMQ_RUNNER_ID as
        the subprocess that was killed (or failed) before it: it takes that one's leases
        over at once. The object that ran the last round is not that restart: once a
        process sharing its name took its leases, it waits for them like for any
        holder's. After a subprocess that ended cleanly (and released them) the same
        object ticks on, taking them back at a new epoch."""
        self.runner = TickRunner(self.broker.context, holder=RUNNER_ID)

    def pull(self, now: int) -> None:
        got = self.puller.pull(64, now=now)
        keep = [m.receipt_handle for m in got if self.rng.random() < 0.8]  # the rest expire
        self.puller.ack(keep, now=now)

    def kill_tick(self, now: int) -> bool:
        """Run a tick in a subprocess and kill it somewhere; True if it died."""
        if self.rng.random() < 0.5:
            point = self.rng.choice(POINTS)
            out = run_job(self.wh, "tick", now, crash_at=point)
            if out.killed:
                self.figures.kills_at_points += 1
        else:
            out = run_job(self.wh, "tick", now, kill_after_s=self.rng.uniform(0.0, 1.5))
            if out.killed:
                self.figures.kills_at_random += 1
        assert out.killed or out.returncode == 0, out.stderr[-3000:]
        if out.returncode != 0:  # it kept its leases: the re-run is a restart
            self.restart()
        return out.killed

    def round(self, r: int) -> None:
        self.produce(r)
        self.clock.advance(seconds=self.rng.choice([5, 20, 45, 90]))
        now = self.clock.now_ms()
        self.pull(now)
        if self.kill_tick(now):
            self.figures.kills += 1
        self.runner.tick(now)  # the re-run, to the end
        self.figures.rounds += 1
        self.check()

    # --- checks -------------------------------------------------------------------------------
    def check(self) -> None:
        report = check_dispatch(self.broker.warehouse, dispatched_only=True)
        assert report.ok, report.describe()
        self.figures.duplicate_offsets = len(report.duplicate_offsets)
        copies = self._copies()
        dup = {k: n for k, n in copies.items() if n > 1}
        self.figures.duplicate_copies = len(dup)
        assert not dup, f"copies written twice: {list(dup.items())[:5]}"
        acc = account(self.broker.context)
        self.figures.unaccounted = len(acc.unaccounted)
        assert acc.ok, acc.unaccounted[:5]

    def _copies(self) -> Counter:
        rows = self.broker.sql(
            "SELECT topic, coalesce(properties['UNIQ_KEY'], msg_id) AS uid, "
            "coalesce(reconsume_times, 0) AS k FROM consume_queue"
        ).collect()
        return Counter((r["topic"], r["uid"], r["k"]) for r in rows if r["topic"] not in HOLD_TOPICS)

    def drain(self, stalled_ticks: int = 8) -> int:
        """Run on until nothing is pending, held or retrying for any group, or until
        ``stalled_ticks`` ticks in a row made no progress (a backlog drains at its own
        pace: each suspend of the orderly queue costs a tick); then check that nothing
        was lost. Returns the ticks it took."""
        best, stalled, ticks = None, 0, 0
        while stalled < stalled_ticks:
            ticks += 1
            self.clock.advance(minutes=10)
            now = self.clock.now_ms()
            self.runner.tick(now)
            self.pull(now)
            acc = account(self.broker.context)
            open_ = sum(g.counts["pending"] + g.counts["held"] + g.counts["retrying"] for g in acc.groups)
            open_ += self._halves_open()
            if not open_:
                break
            best, stalled = (open_, 0) if best is None or open_ < best else (best, stalled + 1)
        self.check()
        self._final()
        return ticks

    def _halves_open(self) -> int:
        seen = self._visible_ids()
        return len(self.committed - seen)

    def _visible_ids(self) -> set[str]:
        rows = self.broker.sql(
            f"SELECT properties['{Prop.TRAN_ID}'] AS tran FROM consume_queue WHERE topic = 'orders' "
            f"AND properties['{Prop.TRAN_ID}'] IS NOT NULL"
        ).collect()
        return {r["tran"] for r in rows}

    def _final(self) -> None:
        acc = account(self.broker.context)
        by_group = {g.group: g for g in acc.groups}
        for group in GROUPS:
            g = by_group[group]
            self.figures.consumed[group] = g.counts["consumed"]
            left = {s: n for s, n in g.counts.items() if s not in ("consumed",) and n}
            assert not left, f"group {group}: not consumed at the end: {left}"
        dlq = self.broker.sql(
            f"SELECT count(*) AS n FROM consume_queue WHERE topic LIKE '{DLQ_PREFIX}%'"
        ).collect()[0]["n"]
        assert dlq == 0, f"{dlq} dead letters: every failing message succeeds on its retry"
        expected = {"push": len(self.sent["orders"]) + len(self.committed), "seq": len(self.sent["fifo"])}
        expected["puller"] = expected["push"]
        visible = self._visible_ids()
        self.figures.lost = sum(max(0, n - self.figures.consumed[g]) for g, n in expected.items())
        self.figures.lost += len(self.committed - visible)
        assert self.figures.lost == 0, (self.figures.consumed, expected, len(self.committed - visible))
        over = {g: self.figures.consumed[g] - n for g, n in expected.items()}
        assert all(0 <= over[g] <= self.allowed[g] for g in expected), (self.figures.consumed, expected)
        assert not (visible & self.rolled_back), "a rolled-back transaction became visible"
        self.figures.conflicts_retried = self.broker.engine.stats.conflicts_retried
        self.figures.seconds = round(time.monotonic() - self.started, 1)
