"""One process of the concurrency test (tests/test_concurrency.py): a tick runner, a
producer or a pull client, on a shared warehouse and a shared accelerated clock.

    python tests/support/concurrent_roles.py <role> <warehouse> <base_ms> <wall0_s> <speed> <for_s> <seed>

Run with tests/ on ``PYTHONPATH`` (tests/test_concurrency.py sets it), so ``support`` imports.

Every process computes the same ``now`` from the wall clock (``ScaledClock``), so all
of them live on one timeline running ``speed`` times faster than real time. A runner
lives several lives: each a ``TickRunner.loop`` under a new holder id for a few
seconds, ended by releasing its leases or by abandoning them (as a crashed runner
does: they expire after the lease TTL). At exit each process prints one JSON line:
its commit conflicts retried and what it did.
"""

from __future__ import annotations

import json
import random
import sys
import time

from deltamq import Broker
from deltamq.errors import LeaseHeld
from support.faultload import FaultLoad


class ScaledClock:
    """Wall time ``speed`` times faster, starting at ``base_ms`` at wall second ``wall0``."""

    def __init__(self, base_ms: int, wall0: float, speed: float) -> None:
        self.base_ms, self.wall0, self.speed = base_ms, wall0, speed

    def now_ms(self) -> int:
        return self.base_ms + int((time.time() - self.wall0) * 1000 * self.speed)


def progress(broker: Broker):
    """What the runners recorded so far (the drainer's ticks left out): ``ticks``,
    ``runners`` that ticked, ``failed`` jobs."""
    return broker.sql(
        "SELECT count(DISTINCT split(holder, ':')[0]) AS runners, count(DISTINCT tick_id) AS ticks, "
        "count_if(status = 'FAILED') AS failed FROM job_runs WHERE holder <> 'drainer'"
    ).collect()[0]


def runner(broker: Broker, name: str, rng: random.Random, until: float, min_ticks: int = 0) -> dict:
    """Lives until ``until``; then on (at most three times as long again) while the runners
    together have recorded fewer than ``min_ticks`` ticks, or only one of them has ticked
    (a loaded machine ticks slowly: CI's once recorded 9 in twice the time). Between
    lives it stays down for a moment, as a restarted process does, so that a released
    lease can pass to another runner."""
    from deltamq.orchestration.tick import TickRunner

    lives = released = abandoned = loops = 0
    start = time.time()
    cap = until + 3 * (until - start)
    while True:
        now = time.time()
        if now >= until:
            if not min_ticks or now >= cap:
                break
            so_far = progress(broker)
            if so_far["ticks"] >= min_ticks and so_far["runners"] >= 2:
                break
            until = now + 3.0  # one more short life
        lives += 1
        r = TickRunner(broker.context, holder=f"{name}:life{lives}")
        life = min(rng.uniform(3.0, 9.0), max(0.0, until - time.time()))
        loops += r.loop(0.2, for_s=life, on_wait=lambda e: None)
        if rng.random() < 0.7:
            try:
                r.release()
                released += 1
            except LeaseHeld:
                pass
        else:
            abandoned += 1  # as if it crashed: its leases expire
        time.sleep(rng.uniform(0.5, 2.0))  # restarting
    return {"lives": lives, "released": released, "abandoned": abandoned, "loops": loops}


def main() -> None:
    role, wh, base_ms, wall0, speed, for_s, seed = sys.argv[1:8]
    min_ticks = int(sys.argv[8]) if len(sys.argv) > 8 else 0
    clock = ScaledClock(int(base_ms), float(wall0), float(speed))
    broker = Broker.open(wh, clock=clock)
    rng = random.Random(int(seed))
    until = time.time() + float(for_s)
    out: dict = {"role": role, "seed": int(seed)}
    if role == "runner":
        out |= runner(broker, f"runner{seed}", rng, until, min_ticks)
    elif role == "producer":
        load = FaultLoad(broker, clock, wh, seed=int(seed))
        r = 0
        while time.time() < until:
            load.produce(r)
            r += 1
            time.sleep(rng.uniform(0.3, 0.8))
        out |= {
            "rounds": r,
            "orders": sorted(load.sent["orders"]),
            "fifo": sorted(load.sent["fifo"]),
            "committed": sorted(load.committed),
            "rolled_back": sorted(load.rolled_back),
        }
    elif role == "puller":
        load = FaultLoad(broker, clock, wh, seed=int(seed))
        load.puller = broker.pull_consumer("puller", "c1")
        n = 0
        while time.time() < until:
            load.pull(clock.now_ms())
            n += 1
            time.sleep(0.2)
        out |= {"pulls": n}
    else:
        raise SystemExit(f"unknown role {role!r}; roles are runner, producer, puller")
    out["conflicts_retried"] = broker.engine.stats.conflicts_retried
    out["commits"] = broker.engine.stats.commits
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
