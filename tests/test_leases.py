"""Leases: one holder per job kind across processes, expiry, epoch fencing, now monotonic."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from deltamq.config import BrokerConfig
from deltamq.errors import ClockError, LeaseHeld, LeaseLost
from deltamq.tables.leases import Leases, LeaseTerms

TERMS = LeaseTerms.of(BrokerConfig())
SHORT = LeaseTerms(1000, TERMS.commits)

_ACQUIRE = textwrap.dedent(
    """
    import sys, time
    from deltamq import Broker
    from deltamq.errors import LeaseHeld
    from deltamq.tables.leases import Leases, LeaseTerms
    wh, holder, ttl, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    b = Broker.open(wh)
    b.reconfigure(lease_ttl_ms=ttl)
    leases = Leases(b.warehouse, holder=holder)
    time.sleep(max(0.0, start_at - time.time()))
    try:
        got = leases.acquire(["dispatch", "promote"], LeaseTerms.of(b.config))
        print("WON", got["dispatch"].epoch, flush=True)
    except LeaseHeld as e:
        print("LOST", e, flush=True)
    """
)


def _spawn(wh, holder, ttl_ms, start_at):
    return subprocess.Popen(
        [sys.executable, "-c", _ACQUIRE, str(wh), holder, str(ttl_ms), str(start_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_lease_excludes_a_second_process(broker, tmp_path):
    wh = tmp_path / "wh"
    p = _spawn(wh, "other-runner", 60_000, 0)
    out, err = p.communicate(timeout=120)
    assert out.startswith("WON 1"), err[-2000:]
    mine = Leases(broker.warehouse, holder="me")
    with pytest.raises(LeaseHeld, match="held by other-runner"):
        mine.acquire(["dispatch"], TERMS)
    with pytest.raises(LeaseHeld):
        broker.tick()


@pytest.mark.slow  # subprocesses
def test_two_processes_racing_one_wins(broker, tmp_path):
    wh = tmp_path / "wh"
    start = time.time() + 6.0  # both start their acquire at the same wall-clock instant
    procs = [_spawn(wh, f"racer-{i}", 60_000, start) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    results = sorted(o.split()[0] for o, _ in outs)
    assert results == ["LOST", "WON"], outs
    rows = broker.sql("SELECT job, holder, epoch FROM leases WHERE job = 'dispatch'").collect()
    assert len(rows) == 1 and rows[0]["holder"].startswith("racer-")


def test_expired_lease_is_taken_over_and_stale_holder_is_fenced(broker):
    wall = [1_000_000]
    old = Leases(broker.warehouse, holder="old", wall=lambda: wall[0])
    new = Leases(broker.warehouse, holder="new", wall=lambda: wall[0])
    assert old.acquire(["dispatch"], SHORT)["dispatch"].epoch == 1
    old.check(["dispatch"])
    wall[0] += 400  # more than half left: renewing commits nothing
    v = broker.sql("SELECT count(*) AS n FROM leases").collect()[0]["n"]
    old.acquire(["dispatch"], SHORT)
    assert broker.sql("SELECT count(*) AS n FROM leases").collect()[0]["n"] == v
    with pytest.raises(LeaseHeld):
        new.acquire(["dispatch"], SHORT)
    wall[0] += 1000  # expired
    assert new.acquire(["dispatch"], SHORT)["dispatch"].epoch == 2
    with pytest.raises(LeaseLost, match="held by new"):
        old.check(["dispatch"])
    with pytest.raises(LeaseHeld):
        old.acquire(["dispatch"], SHORT)


def test_release_lets_another_holder_in(broker):
    a = Leases(broker.warehouse, holder="a")
    b = Leases(broker.warehouse, holder="b")
    a.acquire(["retain"], TERMS)
    a.release(TERMS.commits)
    assert b.acquire(["retain"], TERMS)["retain"].epoch == 2


def test_now_earlier_than_last_tick_is_refused(broker, clock, tmp_path):
    from deltamq import Broker

    broker.tick()
    with pytest.raises(ClockError, match="earlier than the warehouse's last tick"):
        broker.tick(clock.now_ms() - 1)
    broker.tick(clock.now_ms())  # equal is fine
    broker.close()
    # a new runner (another process after the lease moved) still knows the last tick
    other = Broker.open(tmp_path / "wh", clock=clock)
    with pytest.raises(ClockError):
        other.tick(clock.now_ms() - 60_000)
    other.close()


def test_a_long_tick_renews_its_lease_between_jobs(broker):
    """A job that runs past half the lease does not leave the next job an expired lease:
    the runner renews before each job (the fence inside the next job then passes)."""
    from deltamq.orchestration.tick import TickRunner

    wall = [1_000_000]
    fenced = []

    def slow(_broker, _now, fence, _runs):
        wall[0] += 700  # 0.7 of the lease per job: two jobs outlive one lease
        fence()
        fenced.append(wall[0])

    seq = (("a", "dispatch", slow), ("b", "dispatch", slow), ("c", "dispatch", slow))
    broker.reconfigure(lease_ttl_ms=1000)
    runner = TickRunner(broker.context, holder="long", sequence=seq)
    runner.leases = Leases(broker.warehouse, holder="long", wall=lambda: wall[0])
    runner.tick(1)
    assert fenced == [1_000_700, 1_001_400, 1_002_100]
    lease = broker.sql("SELECT holder, epoch, expires_at FROM leases WHERE job = 'dispatch'").collect()[0]
    assert (lease["holder"], lease["epoch"], lease["expires_at"]) == ("long", 1, 1_002_400)
