"""The main story on an S3 warehouse behind the fault proxy (tests/support/fault_proxy.py):
the mixed workload of :mod:`support.faultload` (normal, delayed, timer, failing, orderly,
transactional and pull-consumed messages, ticks SIGKILLed) plus an exactly-once sink,
with the store failing at random (503 SlowDown, 500, connection resets, writes whose
answer is lost), then during an outage, then not at all. Used by
tests/test_story_faults.py (slow tier) and ``bench/reliability.py --store-faults``.

Every call that fails must raise an error that names the store and the cause; the
harness then does what a user does (runs the tick again, sends again). A send that
failed may still have landed: its messages are allowed, never required. At the end every
send that returned is indexed once with dense offsets and consumed by every group, the
sink holds each entry once, and the data-quality suite passes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deltamq import Broker, Message
from support.crash import run_job
from support.faultload import POINTS, FaultLoad

T = TypeVar("T")

RATES = {"slowdown": 0.02, "reset": 0.01, "error500": 0.01, "lost_ack": 0.01}
"""Per request: 5 % of all requests faulted, in the proportions S3 shows under load."""

# deltamq's own words for a store's failure (storage.describe_cause), not the store's
_CAUSE = re.compile(
    r"the store failed the request|the endpoint cannot be reached|the store refused the request"
)


@dataclass
class StoreFigures:
    requests: int = 0
    faulted: dict[str, int] = field(default_factory=dict)
    failed_calls: int = 0  # calls that raised (each named the store and the cause)
    failed_ticks: int = 0  # ticks (in-process or subprocess) that failed and were run again
    ticks_recovered: int = 0  # of those, ones whose re-run succeeded
    failed_sends: int = 0  # sends that raised: their messages may or may not exist
    errors: list[str] = field(default_factory=list)  # the first line of each, for the record
    sink_entries: int = 0
    sink_twice: int = 0


class StoreFaultLoad(FaultLoad):
    """:class:`FaultLoad` on an S3 location, every request through the fault proxy."""

    def __init__(self, broker: Broker, clock, location: str, faults, bucket: str, seed: int = 1) -> None:
        super().__init__(broker, clock, location, seed=seed)  # type: ignore[arg-type]
        self.location, self.faults, self.bucket = location, faults, bucket
        self.store = StoreFigures()
        self.ledger: dict[str, int] = {}  # entry → amount, of sends that returned
        self.maybe: dict[str, int] = {}  # entries of sends that raised

    # --- every call a user makes, checked when it fails ----------------------------------------
    def call(self, what: str, fn: Callable[[], T], attempts: int = 6) -> T:
        """``fn()``, again after a failure as a user would; each failure must name the store
        (the bucket or the warehouse) and the cause."""
        for attempt in range(attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - every failure is checked, then retried
                self._failed(what, str(e))
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _failed(self, what: str, text: str) -> None:
        self.store.failed_calls += 1
        first = text.strip().splitlines()[0] if text.strip() else ""
        self.store.errors.append(f"{what}: {first[:300]}")
        named = self.bucket in text or self.location in text
        assert named, f"{what} failed without naming the store: {text[:2000]}"
        assert _CAUSE.search(text), f"{what} failed without naming the cause: {text[:2000]}"

    # --- the workload, with a sink ---------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        b = self.broker
        b.create_topic("ledger", queues=2)
        b.create_group("lake", consume_from="FIRST_OFFSET")
        b.subscribe("lake", "ledger")
        self.sink = b.sink_to_table(
            "lake", f"{self.location}-ledger", ["entry"], "support.listeners:ledger_rows"
        )

    def produce(self, r: int) -> None:
        before = {t: set(ids) for t, ids in self.sent.items()}
        msgs, txs = self.figures.messages, (set(self.committed), set(self.rolled_back))
        try:
            super().produce(r)
        except Exception as e:  # noqa: BLE001 - a send that failed: checked, and allowed to exist
            self._failed("send", str(e))
            self.store.failed_sends += 1
            for group, n in (("push", 16), ("puller", 16), ("seq", 6)):  # at most a round's worth
                self.allowed[group] += n
            self.figures.messages = msgs  # only what returned counts as sent
            self.sent = {t: ids | before[t] for t, ids in self.sent.items()}
            self.committed, self.rolled_back = txs
        entries = {f"r{r}l{i}": 10 * r + i for i in range(4)}
        batch = [Message("ledger", str(a), keys=k) for k, a in entries.items()]
        try:
            self.broker.producer("p").send_batch(batch)
            self.ledger.update(entries)
        except Exception as e:  # noqa: BLE001
            self._failed("send", str(e))
            self.store.failed_sends += 1
            self.maybe.update(entries)

    def pull(self, now: int) -> None:
        self.call("pull", lambda: super(StoreFaultLoad, self).pull(now))

    def kill_tick(self, now: int) -> bool:
        """A tick in a subprocess, killed somewhere, or failing on the store (named)."""
        env = dict(self.faults.options)
        if self.rng.random() < 0.5:
            out = run_job(self.location, "tick", now, crash_at=self.rng.choice(POINTS), env=env)
            self.figures.kills_at_points += out.killed
        else:
            out = run_job(self.location, "tick", now, kill_after_s=self.rng.uniform(0.0, 3.0), env=env)
            self.figures.kills_at_random += out.killed
        if not out.killed and out.returncode != 0:
            self._failed("tick (subprocess)", out.stderr + out.stdout)
            self.store.failed_ticks += 1
        if out.returncode != 0:  # it kept its leases: the re-run is a restart
            self.restart()
        return out.killed

    def tick(self, now: int) -> Any:
        failed_before = self.store.failed_calls
        result = self.call("tick", lambda: self.runner.tick(now))
        assert result.ok, str(result)
        if self.store.failed_calls > failed_before:
            self.store.failed_ticks += 1
            self.store.ticks_recovered += 1
        return result

    def round(self, r: int, kill: bool = True) -> None:
        """A round of FaultLoad's; ``kill=False``: the tick runs only here, not killed."""
        self.produce(r)
        self.clock.advance(seconds=self.rng.choice([5, 20, 45, 90]))
        now = self.clock.now_ms()
        self.pull(now)
        if kill and self.kill_tick(now):
            self.figures.kills += 1
        self.tick(now)  # the re-run, to the end
        self.figures.rounds += 1
        self.call("check", self.check)

    # --- the end ---------------------------------------------------------------------------------
    def _final(self) -> None:
        """FaultLoad's end checks (allowing the messages of sends that failed), then the sink."""
        super()._final()
        rows = self.sink.read().collect()
        entries = [r["entry"] for r in rows]
        self.store.sink_entries = len(entries)
        self.store.sink_twice = len(entries) - len(set(entries))
        assert self.store.sink_twice == 0, "an entry applied twice in the sink"
        got = {r["entry"]: r["amount"] for r in rows}
        missing = {k for k in self.ledger if got.get(k) != self.ledger[k]}
        assert not missing, f"sink entries lost or wrong: {sorted(missing)[:5]}"
        extra = set(got) - set(self.ledger) - set(self.maybe)
        assert not extra, f"sink entries nobody sent: {sorted(extra)[:5]}"
        state = self.faults.state()
        self.store.requests, self.store.faulted = state["requests"], state["faulted"]
