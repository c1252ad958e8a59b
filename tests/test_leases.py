"""Leases: one holder per job kind across processes, expiry, epoch fencing, now monotonic."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from deltamq.config import BrokerConfig, CommitPolicy
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
    wall[0] += 1000  # expired by the wall clock, but within the allowance for clock skew
    with pytest.raises(LeaseHeld, match="allowance for clock skew"):
        new.acquire(["dispatch"], SHORT)
    wall[0] += 1000  # past its expiry by one more TTL
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
    runner.leases = Leases(broker.warehouse, holder="long", wall=lambda: wall[0], mono=lambda: wall[0])
    runner.tick(1)
    assert fenced == [1_000_700, 1_001_400, 1_002_100]
    lease = broker.sql("SELECT holder, epoch, expires_at FROM leases WHERE job = 'dispatch'").collect()[0]
    # renewed at the last step's fence too (0.7 of the lease gone): its expiry is a lease on
    assert (lease["holder"], lease["epoch"], lease["expires_at"]) == ("long", 1, 1_003_100)


def test_a_step_longer_than_its_lease_keeps_it_while_nobody_took_it(broker):
    """A step whose work outlasts the whole lease (a deliver pass whose listeners run past
    it) used to fail at its fence with LeaseLost, however nobody else wanted the lease: the
    tick failed, its outcomes were dropped, and three such passes dead-lettered healthy
    messages as poison. The fence renews a lease still ours; one another runner took stays
    lost."""
    from deltamq.orchestration.tick import TickRunner

    wall = [1_000_000]
    fenced = []

    def slow(_broker, _now, fence, _runs):
        wall[0] += 1_200  # past the whole lease before the step's first commit
        fence()
        fenced.append(wall[0])

    broker.reconfigure(lease_ttl_ms=1000)
    runner = TickRunner(broker.context, holder="long", sequence=(("a", "dispatch", slow),))
    runner.leases = Leases(broker.warehouse, holder="long", wall=lambda: wall[0], mono=lambda: wall[0])
    assert runner.tick(1).ok and fenced == [1_001_200]
    lease = broker.sql("SELECT holder, epoch, expires_at FROM leases WHERE job = 'dispatch'").collect()[0]
    # taken again at the next epoch: the row was still ours
    assert (lease["holder"], lease["epoch"], lease["expires_at"]) == ("long", 2, 1_002_200)

    def taken_meanwhile(_broker, _now, fence, _runs):
        wall[0] += 2_500  # past the lease and the allowance a taker waits for
        other = Leases(broker.warehouse, holder="other", wall=lambda: wall[0], mono=lambda: wall[0])
        other.acquire(["dispatch"], LeaseTerms(1000, broker.config.commit_policy))
        fence()

    runner.sequence = (("a", "dispatch", taken_meanwhile),)
    with pytest.raises(LeaseLost, match=r"held by other .*this runner \(long\) stops writing"):
        runner.tick(2)


def test_leases_falling_due_together_are_renewed_in_one_commit(broker):
    """A slow first job leaves every lease of the tick past half its time: the next job's
    renewal renews them all in one commit, not one commit per job."""
    from deltamq.orchestration.tick import TickRunner

    wall = [1_000_000]
    fenced = []

    def slow(_broker, _now, fence, _runs):
        wall[0] += 600
        fence()

    def fast(_broker, _now, fence, _runs):
        fence()
        fenced.append(wall[0])

    seq = (("a", "dispatch", slow), ("b", "deliver", fast), ("c", "promote", fast), ("d", "retain", fast))
    broker.reconfigure(lease_ttl_ms=1000)
    runner = TickRunner(broker.context, holder="long", sequence=seq)
    runner.leases = Leases(broker.warehouse, holder="long", wall=lambda: wall[0], mono=lambda: wall[0])
    log = Path(broker.warehouse.uri("leases")) / "_delta_log"

    def commits() -> int:
        return len(list(log.glob("*.json")))

    before = commits()
    runner.tick(1)
    assert fenced == [1_000_600] * 3
    assert commits() - before == 2  # the tick's start, then one renewal of all four
    rows = broker.sql("SELECT job, holder, expires_at FROM leases ORDER BY job").collect()
    assert {(r["job"], r["holder"], r["expires_at"]) for r in rows} == {
        (job, "long", 1_001_600) for job in ("dispatch", "deliver", "promote", "retain")
    }


def _paused_tick(broker, meanwhile):
    """A runner whose first job pauses past two lease TTLs (``meanwhile`` runs in the
    pause); the second step, promote, records the memory it is given."""
    from deltamq.orchestration.tick import TickRunner

    wall = [1_000_000]
    seen = []

    def pause(_runner, now, fence, _runs):
        fence()
        if now > 1:  # the runner's first tick (at 1) runs straight through
            wall[0] += 2_100
            meanwhile(wall)

    def probe(runner, _now, fence, _runs):
        fence()
        seen.append(runner.promote_memory)

    broker.reconfigure(lease_ttl_ms=1000)
    seq = (("a", "dispatch", pause), ("b", "promote", probe))
    runner = TickRunner(broker.context, holder="a", sequence=seq)
    runner.leases = Leases(broker.warehouse, holder="a", wall=lambda: wall[0], mono=lambda: wall[0])
    return runner, seen


def test_a_lease_retaken_at_a_new_epoch_mid_tick_drops_what_the_job_remembered(broker):
    """Nobody took the lapsed leases: the renewal before promote takes them again at a new
    epoch, and promote starts from the tables (its memory is dropped, as at a tick's
    start), since another runner could have run it in between."""
    runner, seen = _paused_tick(broker, lambda _wall: None)
    runner.tick(1)
    runner.tick(2)
    assert len(seen) == 2 and seen[1] is not seen[0]
    assert broker.sql("SELECT epoch FROM leases WHERE job = 'promote'").collect()[0][0] == 2


def test_a_tick_stops_when_a_runner_ticked_later_while_its_lease_had_lapsed(broker):
    """While this runner was paused, another took promote over, ticked at a later now and
    released it: taking it back mid-tick, this tick (at an earlier now) stops instead of
    running promote behind the other runner's time."""

    def other_runner_ticks(wall):
        b = Leases(broker.warehouse, holder="b", wall=lambda: wall[0], mono=lambda: wall[0])
        b.acquire(["promote"], SHORT, last_now=50)
        b.release(SHORT.commits, ["promote"])

    runner, seen = _paused_tick(broker, other_runner_ticks)
    runner.tick(1)
    with pytest.raises(LeaseLost, match="another runner ticked at 50"):
        runner.tick(2)
    assert len(seen) == 1  # the first tick's
    with pytest.raises(ClockError, match="earlier than the warehouse's last tick"):
        runner.tick(3)  # the later now found mid-tick is kept: time does not go back next tick


def test_a_lease_lost_meanwhile_does_not_stop_the_renewal_of_the_jobs_own(broker):
    """The renewal before a job takes the holder's other due leases along; one of them
    another runner took over meanwhile: the job's own lease is renewed all the same, the
    other's row is left as the taker wrote it, and that job is fenced at its own check."""
    t = [0]
    terms = LeaseTerms(1000, TERMS.commits)
    a = Leases(broker.warehouse, holder="a", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    b = Leases(broker.warehouse, holder="b", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    a.acquire(["dispatch", "promote"], terms)
    t[0] = 2_100  # a was paused past two TTLs: b takes promote over
    assert b.acquire(["promote"], terms)["promote"].holder == "b"
    a.renew_due(["dispatch"], terms)  # promote was due too, and is b's now
    rows = {r["job"]: r for r in broker.sql("SELECT job, holder, expires_at FROM leases").collect()}
    assert (rows["dispatch"]["holder"], rows["dispatch"]["expires_at"]) == ("a", 5_000_000 + 2_100 + 1000)
    assert (rows["promote"]["holder"], rows["promote"]["expires_at"]) == ("b", 5_000_000 + 2_100 + 1000)
    a.check(["dispatch"])
    with pytest.raises(LeaseLost):
        a.check(["promote"])


def test_a_renewal_that_loses_one_row_to_a_racing_taker_records_the_rows_it_won(broker):
    """Between the renewal's read and its compare-and-set another runner takes one of the
    leases taken along: the rows whose compare-and-set held are renewed and recorded as
    held (at the epoch written), so their jobs' checks pass; the lost one's fails."""
    t = [0]
    terms = LeaseTerms(1000, TERMS.commits)
    a = Leases(broker.warehouse, holder="a", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    b = Leases(broker.warehouse, holder="b", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    a.acquire(["dispatch", "promote", "retain"], terms)
    t[0] = 2_100  # every lease of a lapsed: its renewal writes each at a new epoch
    cas = a._cas

    def raced(*args, **kwargs):
        if b.held.get("retain") is None:
            b.acquire(["retain"], terms)  # lands between a's read and a's compare-and-set
        return cas(*args, **kwargs)

    a._cas = raced
    a.renew_due(["dispatch"], terms)
    a.check(["dispatch"])
    a.check(["promote"])  # renewed along, at its new epoch
    with pytest.raises(LeaseLost):
        a.check(["retain"])
    assert broker.sql("SELECT holder FROM leases WHERE job = 'retain'").collect()[0][0] == "b"


def test_a_renewal_at_the_same_epoch_racing_a_takeover_leaves_one_holder(broker):
    """a reads its row just before the row's expiry, so it renews at the same epoch; b,
    which has watched the row unchanged for a TTL, reads it just after and takes it over.
    a's renewal lands between b's read and b's compare-and-set. The row b saw lapse is not
    the row a renewed: b's takeover must miss (before, it matched on holder and epoch, and
    b took over a lease that a had just renewed for a whole TTL)."""
    t = [0]
    terms = LeaseTerms(1000, TERMS.commits)
    a = Leases(broker.warehouse, holder="a", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    b = Leases(broker.warehouse, holder="b", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    a.acquire(["retain"], terms)
    with pytest.raises(LeaseHeld):
        b.acquire(["retain"], terms)  # b starts watching the row
    a_cas, b_cas = a._cas, b._cas
    outcome: list[str] = []

    def a_commits_late(*a_args):
        t[0] = 1_000  # b reads now: unchanged for a TTL, lapsed

        def a_lands_first(*b_args):
            a_cas(*a_args)
            b_cas(*b_args)

        b._cas = a_lands_first
        try:
            b.acquire(["retain"], terms)
            outcome.append("b took it")
        except LeaseHeld as e:
            outcome.append(str(e))

    a._cas = a_commits_late
    t[0] = 999  # a reads: by the row's expiry still its own, half its time gone
    a.renew_due(["retain"], terms)
    assert outcome == ["job 'retain' was renewed by its holder a while acquiring"]
    a.check(["retain"])
    row = broker.sql("SELECT holder, epoch, expires_at FROM leases WHERE job = 'retain'").collect()[0]
    assert (row["holder"], row["epoch"], row["expires_at"]) == ("a", 1, 5_000_000 + 999 + 1000)


@pytest.mark.parametrize("skew", [999, 400, -999], ids=["ahead", "a-little-ahead", "behind"])
def test_skewed_clocks_never_let_two_holders_act(broker, skew):
    """Two runners whose wall clocks differ by up to the TTL (1 s here), on clocks that run
    at one rate: a holds and renews, then stops (paused or dead); b tries every 100 ms.
    b never holds while a would still pass its own check, and b takes over within two
    TTLs of a's last write however its clock is skewed."""
    ttl = 1000
    terms = LeaseTerms(ttl, TERMS.commits)
    t = [0]  # real time, ms
    base = 5_000_000
    a = Leases(broker.warehouse, holder="a", wall=lambda: base + t[0], mono=lambda: t[0])
    b = Leases(broker.warehouse, holder="b", wall=lambda: base + t[0] + skew, mono=lambda: t[0])
    a.acquire(["retain"], terms)
    last_write = 0
    a_valid_at: list[int] = []
    b_at = None
    while b_at is None and t[0] < 6 * ttl:
        t[0] += 100
        if t[0] <= 1500:  # a is alive: it renews when half its time is gone
            before = broker.sql("SELECT expires_at FROM leases WHERE job = 'retain'").collect()[0][0]
            a.renew_due(["retain"], terms)
            after = broker.sql("SELECT expires_at FROM leases WHERE job = 'retain'").collect()[0][0]
            last_write = t[0] if after != before else last_write
        try:
            a.check(["retain"])
            a_valid_at.append(t[0])
        except LeaseLost:
            pass
        try:
            b.acquire(["retain"], terms)
            b_at = t[0]
        except LeaseHeld:
            pass
    assert b_at is not None, "b never took the lease over"
    assert max(a_valid_at) < b_at, (max(a_valid_at), b_at)
    assert b_at <= last_write + 2 * ttl + 100, (last_write, b_at)
    with pytest.raises(LeaseLost):
        a.check(["retain"])


@pytest.mark.parametrize(("holder_ttl", "taker_ttl"), [(1000, 60_000), (60_000, 1000)])
def test_a_lease_is_taken_over_after_the_holders_ttl_not_the_takers(broker, holder_ttl, taker_ttl):
    """Runners configured with different TTLs: the taker waits for the TTL the holder
    wrote into the row (its own TTL would be too long to wait, or too short to be safe)."""
    t = [0]
    a = Leases(broker.warehouse, holder="a", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    b = Leases(broker.warehouse, holder="b", wall=lambda: 5_000_000 + t[0], mono=lambda: t[0])
    a.acquire(["retain"], LeaseTerms(holder_ttl, TERMS.commits))
    assert broker.sql("SELECT ttl_ms FROM leases WHERE job = 'retain'").collect()[0][0] == holder_ttl
    taker = LeaseTerms(taker_ttl, TERMS.commits)
    with pytest.raises(LeaseHeld, match=f"taken over {holder_ttl} ms after that"):
        b.acquire(["retain"], taker)  # b starts watching the row
    t[0] = holder_ttl - 1  # a's lease is still valid by a's own clock
    a.check(["retain"])
    with pytest.raises(LeaseHeld):
        b.acquire(["retain"], taker)
    t[0] = holder_ttl + 1  # watched unchanged for the holder's TTL
    assert b.acquire(["retain"], taker)["retain"].holder == "b"
    with pytest.raises(LeaseLost):
        a.check(["retain"])


def test_a_runner_whose_clock_is_behind_holds_time_and_no_timer_fires_early_beyond_the_skew(
    warehouse_with, clock, caplog
):
    """Runner a's clock is 20 s ahead (less than the 60 s lease TTL), runner b's is right.
    a fires what is due by its clock: early by at most the skew. b, taking over after a
    released, finds its clock behind the last tick's now: it ticks at that now (time never
    goes back, and nothing is refused), and fires the rest at their due time by its clock."""
    from datetime import timedelta

    from deltamq import Message
    from deltamq.orchestration.tick import TickRunner

    broker = warehouse_with("orders", queues=1).broker
    skew = 20_000
    t0 = clock.now_ms()
    p = broker.producer("p")
    p.send(Message("orders", "t10", delay=timedelta(seconds=10)))
    p.send(Message("orders", "t30", delay=timedelta(seconds=30)))

    def visible() -> list[str]:
        """Messages a consumer can be handed at the last tick's now (copies promoted ahead
        wait in the queue for their due time)."""
        rows = broker.sql(
            "SELECT CAST(c.body AS STRING) AS b FROM consume_queue q JOIN commit_log c "
            "ON c.msg_id = q.msg_id WHERE q.topic = 'orders' "
            "AND (q.due_ts IS NULL OR q.due_ts <= (SELECT max(now_ts) FROM job_runs)) "
            "ORDER BY q.queue_offset"
        ).collect()
        return [r["b"] for r in rows]

    a = TickRunner(broker.context, holder="a")
    clock.set(t0 + 1_000)
    a.tick(clock.now_ms() + skew)  # a's clock reads t0 + 21 s
    assert visible() == ["t10"]  # due at t0 + 10 s: 9 s early by the true time, within the skew
    a.release()
    b = TickRunner(broker.context, holder="b")
    clock.set(t0 + 2_000)
    with caplog.at_level("WARNING"):
        result = b.tick()
    assert result.now == t0 + 1_000 + skew  # held at the last tick's now
    assert "behind the warehouse's last tick" in caplog.text
    assert visible() == ["t10"]
    clock.set(t0 + 29_999)
    b.tick()
    assert visible() == ["t10"]
    clock.set(t0 + 30_000)
    b.tick()
    assert visible() == ["t10", "t30"]
    clock.set(t0 + 30_000 - broker.config.lease_ttl_ms - 1)
    with pytest.raises(ClockError):  # a clock behind by more than the TTL is refused
        b.tick()
    b.release()


def test_two_processes_sharing_a_runner_id_fence_each_other(broker):
    """DELTAMQ_RUNNER_ID gives a runner a stable name so that a restart keeps its leases.
    Two live processes under one name used to share them at one epoch: both passed their
    checks and ran the same jobs, and the one that closed first released the other's
    leases. The one that takes a row over under our name takes it at the next epoch."""
    terms = LeaseTerms(60_000, broker.config.commit_policy)
    loop = Leases(broker.warehouse, holder="svc")
    loop.acquire(["deliver"], terms)
    one_shot = Leases(broker.warehouse, holder="svc")  # the same name, another process
    one_shot.acquire(["deliver"], terms)  # a restart takes over at once, as before
    assert one_shot.held["deliver"].epoch == loop.held["deliver"].epoch + 1
    with pytest.raises(LeaseLost, match="epoch 2"):
        loop.check(["deliver"])  # the older one is fenced
    # and waits for it like for any holder: taking it straight back would fence the other
    # mid-pass, and so on, tick after tick
    with pytest.raises(LeaseHeld, match="held by svc"):
        loop.acquire(["deliver"], terms)
    loop.release(broker.config.commit_policy)  # releases nothing it no longer holds
    row = broker.sql("SELECT holder, epoch, expires_at FROM leases WHERE job = 'deliver'").collect()[0]
    assert (row["holder"], row["epoch"]) == ("svc", 2) and row["expires_at"] > 0
    one_shot.check(["deliver"])


def test_a_renewal_whose_commit_answer_was_lost_is_still_ours(broker):
    """A lease renewed at the next epoch (it had lapsed by the wall clock) whose commit
    landed but whose answer was lost (the store failed on the read back, and the attempt
    was retried) used to read as another process's row under our name: the runner fenced
    itself and waited a TTL, failing every tick meanwhile (seen in the store-fault story)."""
    wall = [1_000_000]

    class LostAnswer(Leases):
        lose = 0

        def _cas(self, *args, **kwargs):
            super()._cas(*args, **kwargs)
            if self.lose:
                self.lose -= 1
                raise ConnectionResetError("connection reset by peer (after the commit)")

    terms = LeaseTerms(1000, broker.config.commit_policy)
    leases = LostAnswer(broker.warehouse, holder="r", wall=lambda: wall[0], mono=lambda: wall[0])
    leases.acquire(["dispatch"], terms)
    wall[0] += 1_500  # lapsed by the wall clock: renewed at the next epoch
    leases.lose = 1  # retried by the commit policy: its second attempt reads epoch 2
    got = leases.acquire(["dispatch"], terms)
    assert got["dispatch"].epoch == 2 and leases.held["dispatch"].epoch == 2
    leases.check(["dispatch"])
    wall[0] += 1_500
    leases.lose = 1
    with pytest.raises(Exception, match="connection reset"):  # no retry: the call fails
        leases.acquire(["dispatch"], LeaseTerms(1000, CommitPolicy(retries=0, backoff_ms=1)))
    assert leases.held["dispatch"].epoch == 2  # its epoch-3 commit landed unseen
    leases.check(["dispatch"])  # the epoch-3 row is known as its own
    assert leases.held["dispatch"].epoch == 3
    # another object under the same name, fenced before, still waits for it
    other = Leases(broker.warehouse, holder="r", wall=lambda: wall[0], mono=lambda: wall[0])
    other.held["dispatch"] = replace(leases.held["dispatch"], epoch=1)
    with pytest.raises(LeaseHeld, match="held by r"):
        other.acquire(["dispatch"], terms)


def test_a_renewal_racing_a_process_under_the_same_name_at_the_same_epoch_is_lost(broker):
    """Two processes under one name, both taking a lapsed row at the next epoch: the one
    whose compare-and-set lost read the winner's row back (its name, the epoch it wanted)
    and counted it as its own, so both held the lease. The expiry it wrote tells them
    apart."""
    wall = [1_000_000]
    terms = LeaseTerms(1000, CommitPolicy(retries=0, backoff_ms=1))

    class Racing(Leases):
        race = False

        def _cas(self, *args, **kwargs):
            if self.race:
                wall[0] += 1  # the other process's clock reads a moment later
                restarted = Leases(broker.warehouse, holder="r", wall=lambda: wall[0], mono=lambda: wall[0])
                restarted.acquire(["dispatch"], terms)  # commits first, at the same epoch
            super()._cas(*args, **kwargs)

    old = Racing(broker.warehouse, holder="r", wall=lambda: wall[0], mono=lambda: wall[0])
    old.acquire(["dispatch"], terms)  # epoch 1
    old.race = True
    wall[0] += 1_500  # lapsed: renewed at epoch 2, racing a restart under the same name
    with pytest.raises(LeaseHeld, match="another process under this runner's name"):
        old.acquire(["dispatch"], terms)
    assert old.held["dispatch"].epoch == 1
    with pytest.raises(LeaseLost):
        old.check(["dispatch"])
