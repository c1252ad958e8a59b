"""Four tick runners on one warehouse, a producer and a pull client, on a shared clock
running 30 times faster than real time (20 minutes of broker time): runners come and go,
releasing their leases or abandoning them as a crashed runner would. Afterwards the
fault-injection checks (conservation, no duplicate offsets, no copy twice, accounting,
nothing lost), with the commit conflicts retried and the lease hand-overs counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.concurrent_roles import ScaledClock, progress
from support.faultload import FaultLoad

from deltamq.errors import LeaseHeld
from deltamq.orchestration.tick import TickRunner

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
SECONDS = float(os.environ.get("DELTAMQ_CONCURRENCY_SECONDS", "30"))
SPEED = 30.0
TTL_MS = 6000
MIN_TICKS = 10  # runners carry on (up to four times as long) until they ticked this often


def run_concurrently(broker, clock, wh: Path, seconds: float = SECONDS, runners: int = 4) -> dict:
    """Spawn the runners, the producer and the puller; wait for them; drain and check.
    Returns the figures (also for bench/reliability.py)."""
    load = FaultLoad(broker, clock, wh, seed=3)
    load.setup()
    base, wall0 = clock.now_ms(), time.time()
    env = dict(os.environ, PYTHONPATH=str(HERE), RUST_LOG="error", DELTAMQ_LEASE_TTL_MS=str(TTL_MS))
    roles = [("runner", i) for i in range(runners)] + [("producer", 10), ("puller", 20)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "support" / "concurrent_roles.py"),
                role,
                str(wh),
                str(base),
                str(wall0),
                str(SPEED),
                str(seconds),
                str(seed),
                str(MIN_TICKS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role, seed in roles
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    produced = next(o for o in outs if o["role"] == "producer")
    load.sent = {"orders": set(produced["orders"]), "fifo": set(produced["fifo"])}
    load.committed, load.rolled_back = set(produced["committed"]), set(produced["rolled_back"])
    load.figures.messages = len(load.sent["orders"]) + len(load.sent["fifo"]) + 2 * produced["rounds"]
    load.figures.transactions = 2 * produced["rounds"]
    clock.set(ScaledClock(base, wall0, SPEED).now_ms())
    load.runner = TickRunner(broker.context, holder="drainer")
    started = time.time()
    deadline = started + 3 * TTL_MS / 1000
    waits: list[str] = []
    while True:  # an abandoned lease is taken over after it stayed unchanged for its TTL
        try:
            load.runner.tick(clock.now_ms())
            break
        except LeaseHeld as e:
            waits.append(f"{time.time() - started:.1f} s: {e}")
            assert time.time() < deadline, "a lease outlived its TTL:\n" + "\n".join(waits)
            time.sleep(0.5)
    drain_ticks = load.drain()
    leases = broker.sql("SELECT job, epoch FROM leases").collect()
    ticked = progress(broker)
    runner_outs = [o for o in outs if o["role"] == "runner"]
    return {
        "seconds": seconds,
        "broker_minutes": round(seconds * SPEED / 60),
        "runners": runners,
        "runners_that_ticked": ticked["runners"],
        "ticks": ticked["ticks"],
        "failed_jobs": ticked["failed"],
        "lease_handovers": sum(r["epoch"] - 1 for r in leases),
        "runner_lives": sum(o["lives"] for o in runner_outs),
        "abandoned_leases": sum(o["abandoned"] for o in runner_outs),
        "conflicts_retried": sum(o["conflicts_retried"] for o in outs)
        + broker.engine.stats.conflicts_retried,
        "commits": sum(o["commits"] for o in outs),
        "messages": load.figures.messages,
        "consumed": load.figures.consumed,
        "drain_ticks": drain_ticks,
        "lost": load.figures.lost,
        "duplicate_copies": load.figures.duplicate_copies,
        "unaccounted": load.figures.unaccounted,
    }


def test_four_runners_a_producer_and_a_puller(broker, clock, tmp_path):
    f = run_concurrently(broker, clock, tmp_path / "wh")
    print(f)
    assert f["runners_that_ticked"] >= 2 and f["lease_handovers"] >= 3 and f["ticks"] >= MIN_TICKS, f
    assert f["messages"] > 100 and f["lost"] == f["duplicate_copies"] == f["unaccounted"] == 0
