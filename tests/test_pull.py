"""Pull consumers, rebalancing and the DeFiBus queue access lock (docs/behaviour.md §6)."""

from __future__ import annotations

import pytest
from conftest import ENGINE, SPARK_ENGINES

from deltamq import Message
from deltamq.errors import ConfigError
from deltamq.pull import RESERVE_MS
from deltamq.rebalance import allocate_averagely
from deltamq.tables.deliveries import LockEntry, decide_lock, positions

SECOND = 1_000


@pytest.fixture
def pulled(warehouse_with, clock):
    broker = warehouse_with(
        "orders", queues=4, group="workers", recorder=None, invisible_time_ms=30 * SECOND
    ).broker
    p = broker.producer("p")
    for q in range(4):
        p.send_batch([Message("orders", f"q{q}m{i}") for i in range(5)], selector=lambda n, m, a: a, arg=q)
    broker.tick(clock.now_ms())
    return broker


def orders_of(queues) -> list[tuple[str, int]]:
    """The 'orders' queues of an assignment (each client also gets its share of the
    group's retry topic, rebalanced on its own like every subscribed topic)."""
    return [q for q in queues if q[0] == "orders"]


def bodies(messages) -> list[str]:
    return [m.body.decode() for m in messages]


@pytest.mark.unit
def test_allocate_averagely_matches_rocketmq():
    qs = [("t", i) for i in range(4)]
    assert allocate_averagely(qs, ["b", "a"], "a") == [("t", 0), ("t", 1)]
    assert allocate_averagely(qs, ["b", "a"], "b") == [("t", 2), ("t", 3)]
    three = {c: allocate_averagely(qs, ["a", "b", "c"], c) for c in "abc"}
    assert three == {"a": [("t", 0), ("t", 1)], "b": [("t", 2)], "c": [("t", 3)]}
    five = {c: allocate_averagely(qs, list("abcde"), c) for c in "abcde"}
    assert five["e"] == [] and sorted(q for v in five.values() for q in v) == qs
    assert allocate_averagely(qs, ["a"], "z") == []


@pytest.mark.unit
def test_receipt_handles_are_checked_all_at_once_and_the_bad_one_is_named():
    from deltamq.pull_log import receipt_handles as _handles

    assert _handles(["0b", "0a", "0b"]) == ["0a", "0b"] and _handles("ff") == ["ff"] and _handles([]) == []
    for bad in (["0a", ""], ["0a", "0G"], ["0a", "AB"], ["0a", 7], ["0a", None]):
        with pytest.raises(ConfigError, match=f"{bad[1]!r} is not a receipt handle"):
            _handles(bad)


@pytest.mark.unit
def test_decide_lock_follows_the_spec():
    kw = {"timeout_ms": 60_000, "max_no_change": 3}
    assert decide_lock(None, "a", 10, 5, 5, **kw)[0] == "acquired"
    owned = LockEntry("a", 10, 5, 0)
    assert decide_lock(owned, "a", 20, 7, 5, **kw) == ("owner", LockEntry("a", 20, 7, 0))
    # another client: refused while anything is unacked; its attempts count unchanged offsets
    v, e = decide_lock(owned, "b", 20, 5, 4, **kw)
    assert (v, e.no_change_count) == ("refused", 1)
    v, e = decide_lock(LockEntry("a", 10, 5, 1), "b", 20, 6, 4, **kw)
    assert (v, e.no_change_count, e.last_delivered_offset) == ("refused", 0, 6)
    # all acked but the counter not yet at the maximum
    assert decide_lock(LockEntry("a", 10, 5, 1), "b", 20, 5, 5, **kw)[0] == "refused"
    assert decide_lock(LockEntry("a", 10, 5, 2), "b", 20, 5, 5, **kw)[0] == "acquired"
    # unacked messages never let a non-owner in, however often it asks, until the timeout
    assert decide_lock(LockEntry("a", 10, 5, 99), "b", 20, 5, 4, **kw)[0] == "refused"
    assert decide_lock(LockEntry("a", 10, 5, 0), "b", 60_011, 5, 4, **kw)[0] == "acquired"


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
def test_four_clients_pulling_at_once_never_conflict_on_the_locks(pulled, clock):
    """Four clients of one group, one queue each, take their locks, reserve, pull and ack
    at the same moment. Each lock row is a partition of its own and each compare-and-set
    names its partitions, so no lock commit conflicts with another client's. On Apache
    Spark a MERGE takes ~1 s and queue_lock was one file: four such clients retried their
    lock commits until one ran out of retries (CommitConflict)."""
    from concurrent.futures import ThreadPoolExecutor

    broker = pulled
    t = clock.now_ms()
    clients = [broker.pull_consumer("workers", c) for c in "abcd"]
    for c in clients:
        c.heartbeat(t)
    assert [orders_of(c.assignment(t)) for c in clients] == [[("orders", q)] for q in range(4)]
    before = broker.engine.stats.by_job.get("queue_lock", 0)

    def consume(client) -> list[str]:
        got: list[str] = []
        for i in range(3):
            batch = client.pull(2, now=t + 1 + i)
            client.ack([m.receipt_handle for m in batch], now=t + 1 + i)
            got += bodies(batch)
        return got

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(consume, clients))
    assert [sorted(r) for r in results] == [[f"q{q}m{i}" for i in range(5)] for q in range(4)]
    if ENGINE in SPARK_ENGINES:  # Sail's checker counts any concurrent commit (docs/engines.md)
        assert broker.engine.stats.by_job.get("queue_lock", 0) == before


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
@pytest.mark.story(s3="slow")
def test_two_clients_split_four_queues_and_a_third_waits_for_acks(pulled, clock):
    broker = pulled
    t = clock.now_ms()
    a, b = broker.pull_consumer("workers", "a"), broker.pull_consumer("workers", "b")
    a.heartbeat(t)
    b.heartbeat(t)
    assert orders_of(a.assignment(t)) == [("orders", 0), ("orders", 1)]
    assert orders_of(b.assignment(t)) == [("orders", 2), ("orders", 3)]
    got_a = a.pull(100, now=t + 1)
    got_b = b.pull(3, now=t + 1)
    assert sorted(bodies(got_a)) == sorted(f"q{q}m{i}" for q in (0, 1) for i in range(5))
    assert bodies(got_b) == ["q2m0", "q2m1", "q2m2"]  # budget: queue order
    # c joins: it is assigned queue 3, which b still holds with nothing in flight there...
    c = broker.pull_consumer("workers", "c")
    c.heartbeat(t + 2)
    assert orders_of(c.assignment(t + 2)) == [("orders", 3)]
    assert orders_of(b.assignment(t + 2)) == [("orders", 2)]
    # b locked queue 3 at its pull (nothing in flight there): c is refused until its own
    # attempts saw the delivered offset unchanged max_deliver_offset_no_change_times (3)
    assert c.pull(10, now=t + 3) == [] and c.pull(10, now=t + 4) == []
    third = c.pull(10, now=t + 5)
    assert bodies(third) == [f"q3m{i}" for i in range(5)]
    # d joins; with nothing acked, every queue's owner has messages in flight: however often
    # anyone pulls, no message is handed to a second client
    d = broker.pull_consumer("workers", "d")
    seen = set(bodies(got_a)) | set(bodies(got_b)) | set(bodies(third))
    for k in range(6):
        for client in (a, b, c, d):
            again = bodies(client.pull(10, now=t + 10 + k))
            assert not (set(again) & seen), "a message handed to two clients while unacked"
            seen |= set(again)
    assert len(seen) == 20


def test_no_queue_changes_hands_until_the_owner_acked(pulled, clock, broker):
    t = clock.now_ms()
    a, b = broker.pull_consumer("workers", "a"), broker.pull_consumer("workers", "b")
    a.heartbeat(t)
    first = a.pull(2, now=t)  # a alone: all four queues; takes q0m0, q0m1
    assert bodies(first) == ["q0m0", "q0m1"]
    b.heartbeat(t + 1)  # now b is assigned queues 2 and 3, a keeps 0 and 1
    assert orders_of(b.assignment(t + 1)) == [("orders", 2), ("orders", 3)]
    c = broker.pull_consumer("workers", "0c")  # sorts first: takes queues 0 and 1 from a
    c.heartbeat(t + 2)
    assert orders_of(c.assignment(t + 2)) == [("orders", 0), ("orders", 1)]
    for k in range(5):  # refused: a has q0m0, q0m1 unacked on queue 0
        got = c.pull(10, now=t + 3 + k)
        assert "q0m0" not in bodies(got) and "q0m1" not in bodies(got)
        assert all(m.queue_id != 0 for m in got)
    a.ack([m.receipt_handle for m in first], now=t + 10)
    # a reserved queue 0 up to its head at its pull; the reservation lapses RESERVE_MS
    # after a's last lock write (a pulls no more: it does not give it back itself)
    later = t + RESERVE_MS
    got = []
    for k in range(4):  # all acked: after max_deliver_offset_no_change_times refusals it moves
        got += c.pull(10, now=later + k)
    assert [b for b in bodies(got) if b.startswith("q0")] == ["q0m2", "q0m3", "q0m4"]  # from the acked offset


def test_owner_timeout_hands_the_queue_over_from_the_acked_offset(pulled, clock, broker):
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(3, now=t)
    assert bodies(got) == ["q0m0", "q0m1", "q0m2"]
    a.ack([got[0].receipt_handle], now=t)
    b = broker.pull_consumer("workers", "b")
    later = t + broker.config.client_timeout_ms + 1  # a is gone: b is alone, owns all queues
    taken = b.pull(2, now=later)
    assert bodies(taken) == ["q0m1", "q0m2"]  # from the acked offset, a's in-flight ones again
    assert a.ack([got[1].receipt_handle], now=later) == 0  # revoked by the takeover
    # the log says where queue 0 stands; the tick's pull_expiry step folds it into offsets
    assert positions(broker.warehouse, "workers", [("orders", 0)]) == {("orders", 0): (1, 3)}
    broker.tick(later)
    offsets = broker.sql(
        "SELECT next_offset, delivered_offset FROM offsets WHERE consumer_group = 'workers' "
        "AND topic = 'orders' AND queue_id = 0"
    ).collect()[0]
    assert (offsets["next_offset"], offsets["delivered_offset"]) == (1, 3)


def test_out_of_order_acks_move_the_acked_offset_to_the_lowest_unacked(pulled, clock, broker):
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(5, now=t)
    assert [m.queue_offset for m in got] == [0, 1, 2, 3, 4]

    def acked():
        return positions(broker.warehouse, "workers", [("orders", 0)])[("orders", 0)][0]

    assert a.ack([got[3].receipt_handle, got[1].receipt_handle], now=t) == 2
    assert acked() == 0
    assert a.ack([got[0].receipt_handle], now=t) == 1
    assert acked() == 2
    assert a.ack([got[2].receipt_handle, got[4].receipt_handle, got[2].receipt_handle], now=t) == 2
    assert acked() == 5
    assert a.ack([got[2].receipt_handle], now=t) == 0  # already acked
    # the tick folds the log into offsets and deletes the rows below the acked offset
    broker.tick(t + 1)
    stored = broker.sql(
        "SELECT next_offset, delivered_offset FROM offsets WHERE consumer_group = 'workers' "
        "AND topic = 'orders' AND queue_id = 0"
    ).collect()
    assert [(r["next_offset"], r["delivered_offset"]) for r in stored] == [(5, 5)]
    assert broker.sql("SELECT count(*) AS n FROM deliveries WHERE queue_id = 0").collect()[0]["n"] == 0
    assert acked() == 5


def test_invisible_time_expiry_and_nack_take_the_retry_path(pulled, clock, broker):
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(3, now=t)
    assert a.nack([got[0].receipt_handle], now=t) == 1
    a.ack([got[2].receipt_handle], now=t)
    run = broker.tick(t + 30 * SECOND).job("pull_expiry")  # got[1] not acked within 30 s
    assert run.details["expired"] == 1
    assert a.ack([got[1].receipt_handle], now=t + 30 * SECOND) == 0
    broker.tick(t + 30 * SECOND + 1)
    retry = broker.sql(
        "SELECT CAST(l.body AS STRING) AS body, c.reconsume_times, c.properties['DELAY'] AS level "
        "FROM consume_queue c JOIN commit_log l ON l.msg_id = c.msg_id "
        "WHERE c.topic = 'SCHEDULE_TOPIC_XXXX' ORDER BY body"
    ).collect()
    assert [(r["body"], r["reconsume_times"], r["level"]) for r in retry] == [
        ("q0m0", 1, "3"),
        ("q0m1", 1, "3"),
    ]
    # 10 s (level 3) after each send-back they are back, in %RETRY%workers, for this client
    later = t + 45 * SECOND
    broker.tick(later)
    again = []
    for k in range(3):
        again += a.pull(20, now=later + k)
    retried = sorted((m.body.decode(), m.reconsume_times, m.topic) for m in again if m.reconsume_times)
    assert retried == [("q0m0", 1, "orders"), ("q0m1", 1, "orders")]
    with pytest.raises(ConfigError, match="not a receipt handle"):
        a.ack(["nope!"])


def test_a_long_poll_returns_at_once_when_something_is_there_and_waits_when_not(pulled, clock):
    import time

    a = pulled.pull_consumer("workers", "a")
    started = time.monotonic()
    got = a.pull(100, wait_ms=5_000)
    assert len(got) == 20 and time.monotonic() - started < 5.0
    a.ack([m.receipt_handle for m in got])
    started = time.monotonic()
    assert a.pull(100, wait_ms=300) == []
    assert time.monotonic() - started >= 0.3
    with pytest.raises(ConfigError, match="wait_ms"):
        a.pull(1, wait_ms=-1)


def test_pull_consumer_refuses_push_and_broadcast_groups(broker):
    broker.create_group("pushy", lambda msgs, ctx: None)
    with pytest.raises(ConfigError, match="push listener"):
        broker.pull_consumer("pushy", "c1")
    with pytest.raises(ConfigError, match="BROADCASTING group is consumed by its push listener"):
        broker.create_group("bc", mode="BROADCASTING")  # nothing could consume it
    assert "bc" not in broker.groups()
    with pytest.raises(ConfigError, match="max_messages"):
        broker.create_group("w")
        broker.pull_consumer("w", "c1").pull(0)


_RACER = """
import os, sys, time
from deltamq import Broker
from deltamq.clock import FakeClock
wh, me, go, now = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
broker = Broker.open(wh, clock=FakeClock(now))
consumer = broker.pull_consumer("workers", me)
broker.engine.rows("SELECT 1")  # warm up before the start line
print("READY", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
held = consumer._lock([("orders", 0)], now, {("orders", 0): 5}, 10)
print("WON" if held else "LOST", flush=True)
"""


def _race(
    script: str,
    wh,
    clients: list[str],
    go,
    *args: str,
    env: dict[str, str] | None = None,
    per_client: dict[str, list[str]] | None = None,
):
    """Start one process per client running ``script`` (argv: warehouse, client, go file,
    *args, then the client's own ``per_client`` args), wait for each one's READY, let them
    go at once; returns their stdout by client."""
    import os
    import subprocess
    import sys
    import time

    env = dict(os.environ, RUST_LOG="error", **(env or {}))
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    procs = {
        c: subprocess.Popen(
            [sys.executable, "-c", script, str(wh), c, str(go), *args, *(per_client or {}).get(c, [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for c in clients
    }
    for p in procs.values():
        assert p.stdout.readline().strip() == "READY"
    time.sleep(0.2)
    go.write_text("go")
    outcomes = {}
    for c, p in procs.items():
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        outcomes[c] = out.strip()
    return outcomes


@pytest.mark.slow  # subprocesses
def test_four_processes_racing_for_one_queue_one_wins(pulled, clock, tmp_path):
    # The losers' refused attempts each count as "delivered offset unchanged"; with nothing
    # in flight, three of them would legitimately hand the queue on (docs/behaviour.md §6). Here the
    # counter may not decide: only the race does.
    outcomes = _race(
        _RACER,
        tmp_path / "wh",
        [f"racer{i}" for i in range(4)],
        tmp_path / "go",
        str(clock.now_ms()),
        env={"DELTAMQ_MAX_DELIVER_OFFSET_NO_CHANGE_TIMES": "1000"},
    )
    winners = [c for c, o in outcomes.items() if o == "WON"]
    assert len(winners) == 1, outcomes
    owner = pulled.sql("SELECT owner FROM queue_lock WHERE topic = 'orders' AND queue_id = 0").collect()
    assert [r["owner"] for r in owner] == winners


_WORKER = """
import json, os, sys, time
from deltamq import Broker
wh, me, go = sys.argv[1], sys.argv[2], sys.argv[3]
batch, delay, stop = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
broker = Broker.open(wh)
consumer = broker.pull_consumer("workers", me)
broker.engine.rows("SELECT 1")
print("READY", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
time.sleep(delay)
got, empty, pulls = [], 0, 0
while empty < 8 and (stop == 0 or pulls < stop):
    msgs = consumer.pull(batch)
    pulls += 1
    if not msgs:
        empty += 1
        time.sleep(0.25)
        continue
    empty = 0
    assert consumer.ack([m.receipt_handle for m in msgs]) == len(msgs)
    got += [[m.body.decode(), m.queue_id, m.queue_offset] for m in msgs]
if stop:
    consumer.close()  # gives its reservations back: the others take its queues at once
print(json.dumps(got), flush=True)
"""


@pytest.mark.slow
def test_three_client_processes_pull_and_ack_everything_once(pulled, clock, tmp_path):
    """Real clocks, client processes rebalancing 4 queues among themselves while pulling and
    acking in batches (each pull reserves ahead in the lock row and appends to the log):
    w0 and w1 start together, w2 joins half a second later (the others give back what they
    reserved on its queues), w1 leaves after a few pulls (close). Every message handed out
    exactly once, every acked offset at the queue's end once the tick folded the log,
    nothing left in flight."""
    import json

    p = pulled.producer("p")
    per_queue = 400
    for q in range(4):
        p.send_batch(
            [Message("orders", f"q{q}n{i}") for i in range(per_queue)], selector=lambda n, m, a: a, arg=q
        )
    pulled.tick(clock.now_ms())
    outcomes = _race(
        _WORKER,
        tmp_path / "wh",
        ["w0", "w1", "w2"],
        tmp_path / "go",
        "20",
        per_client={"w0": ["0", "0"], "w1": ["0", "6"], "w2": ["0.5", "0"]},
    )
    got = {c: json.loads(out.splitlines()[-1]) for c, out in outcomes.items()}
    handed = [tuple(m) for msgs in got.values() for m in msgs]
    expected = {f"q{q}m{i}" for q in range(4) for i in range(5)} | {
        f"q{q}n{i}" for q in range(4) for i in range(per_queue)
    }
    assert sorted(b for b, _, _ in handed) == sorted(expected)  # each once
    assert len({(q, o) for _, q, o in handed}) == len(handed)
    assert all(got.values()), {c: len(v) for c, v in got.items()}  # each client got its share
    assert positions(pulled.warehouse, "workers", [("orders", q) for q in range(4)]) == {
        ("orders", q): (per_queue + 5, per_queue + 5) for q in range(4)
    }
    pulled.tick(clock.now_ms() + 1)  # the pull_expiry step folds the log into offsets
    acked = pulled.sql(
        "SELECT queue_id, next_offset FROM offsets WHERE consumer_group = 'workers' AND topic = 'orders'"
    ).collect()
    assert {r["queue_id"]: r["next_offset"] for r in acked} == {q: per_queue + 5 for q in range(4)}
    assert pulled.sql("SELECT count(*) AS n FROM deliveries").collect()[0]["n"] == 0


def test_status_shows_the_rebalance_and_the_locks(pulled, clock, broker):
    t = clock.now_ms()
    a, b = broker.pull_consumer("workers", "a"), broker.pull_consumer("workers", "b")
    b.heartbeat(t)
    got = a.pull(2, now=t)
    clients = {c["client"]: c for c in broker.status()["pull_clients"]}
    assert clients["a"]["assigned"] == [("%RETRY%workers", 0), ("orders", 0), ("orders", 1)]
    assert clients["b"]["assigned"] == [("orders", 2), ("orders", 3)]
    assert clients["a"]["locked"] == [("%RETRY%workers", 0), ("orders", 0), ("orders", 1)]
    assert clients["a"]["in_flight"] == len(got) == 2 and clients["b"]["locked"] == []


def test_status_counts_acks_and_nacks_before_the_tick_folds_them(pulled, clock, broker):
    """The lag of a pull group read its folded offsets only: acked and nacked messages
    counted as not consumed until the next tick folded the deliveries log (and `group
    delete` refused the group for them)."""
    t = clock.now_ms()
    client = broker.pull_consumer("workers", "a")
    got = [m for m in client.pull(20, now=t) if m.queue_id == 0]
    assert [m.queue_offset for m in got] == [0, 1, 2, 3, 4]
    client.ack([m.receipt_handle for m in got[:2]], now=t)  # 0, 1 consumed
    client.nack([got[2].receipt_handle], now=t)  # 2 sent back: its retry copy carries it

    def lag() -> dict[tuple[str, int], int]:
        rows = broker.status()["lag"]
        return {(x["topic"], x["queue_id"]): x["lag"] for x in rows if x["group"] == "workers"}

    assert lag()[("orders", 0)] == 2  # 3 and 4, pulled and not acked yet
    assert broker.status()["groups"][0]["lag"] == 2 + 3 * 5  # the other queues: pulled, not acked
    broker.tick(t)  # the fold stores what the log said; the retry copy waits in a delay level
    assert lag()[("orders", 0)] == 2


def test_a_client_stops_when_its_group_becomes_a_sink_or_is_deleted(pulled, clock, broker, tmp_path):
    """A client kept the configuration it was created with: made a sink's after that, its
    group's messages went to the client and the sink alike; deleted, it went on pulling."""
    from deltamq.errors import UnknownGroup

    t = clock.now_ms()
    early = broker.pull_consumer("workers", "early")  # created, nothing pulled yet
    broker.sink_to_table("workers", str(tmp_path / "sink"), "msg_id")
    with pytest.raises(ConfigError, match=r"'workers' is a sink into"):
        early.pull(10, now=t)
    broker.create_group("later", consume_from="FIRST_OFFSET")
    broker.subscribe("later", "orders")
    client = broker.pull_consumer("later", "c1")
    got = client.pull(5, now=t)
    client.ack([m.receipt_handle for m in got], now=t)
    broker.delete_group("later", force=True)
    later = t + broker.config.client_timeout_ms  # the client reads its group again
    with pytest.raises(UnknownGroup, match=r"'later' was deleted .* since this client was created"):
        client.pull(5, now=later)


def test_a_fold_after_a_takeover_keeps_the_new_owners_acked_position(pulled, clock, broker):
    """a times out with q0m0..q0m3 in flight; b takes queue 0 over and acks q0m0, q0m1.
    The fold must not forget b's epoch while a's revoked rows above it remain: a third
    client taking over from b starts at q0m2, never at the acked q0m0 again."""
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    assert bodies(a.pull(4, now=t)) == ["q0m0", "q0m1", "q0m2", "q0m3"]
    b = broker.pull_consumer("workers", "b")
    later = t + broker.config.client_timeout_ms + 1
    taken = [m for m in b.pull(2, now=later) if m.queue_id == 0]
    assert bodies(taken) == ["q0m0", "q0m1"]
    assert b.ack([m.receipt_handle for m in taken], now=later) == 2
    for k in range(2):  # the first fold deletes the rows below the acked offset, the next reads what is left
        broker.tick(later + 1 + k)
        assert positions(broker.warehouse, "workers", [("orders", 0)]) == {("orders", 0): (2, 2)}
    c = broker.pull_consumer("workers", "c")
    much_later = later + broker.config.client_timeout_ms + 10
    again = [m for m in c.pull(10, now=much_later) if m.queue_id == 0]
    assert bodies(again) == ["q0m2", "q0m3", "q0m4"]


def test_a_fold_keeps_a_takeover_that_came_after_it_read_the_log(pulled, clock, broker):
    """The fold reads the log, then deletes the rows below the acknowledged offset: a
    takeover appended in between (its TAKEN row sits just below that offset) survives."""
    from deltamq.jobs import pull_expiry
    from deltamq.tables import deliveries

    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = [m for m in a.pull(4, now=t) if m.queue_id == 0]
    assert a.ack([got[0].receipt_handle, got[1].receipt_handle], now=t) == 2  # acked: 2; q0m2, q0m3 in flight
    logs = deliveries.summary(broker.warehouse)  # what the fold read
    b = broker.pull_consumer("workers", "b")
    later = t + broker.config.client_timeout_ms + 1
    assert bodies([m for m in b.pull(1, now=later) if m.queue_id == 0]) == ["q0m2"]  # TAKEN at offset 1
    pull_expiry.fold(broker.context, later, logs)
    assert positions(broker.warehouse, "workers", [("orders", 0)]) == {("orders", 0): (2, 3)}
    rest = [m for m in b.pull(10, now=later + 1) if m.queue_id == 0]
    assert bodies(rest) == ["q0m3", "q0m4"]  # a's q0m3 again (revoked), then the new one


def test_the_logs_summary_from_the_files_is_the_engines(pulled, clock, broker):
    """Every class of handle in the log (a takeover mark, revoked, ended, a nack requested
    by a client without an engine, in flight): the fold's summary read from the files is
    the one the engine's statement computes, whole and for one group's queues."""
    from deltamq.lite import PullConsumer
    from deltamq.tables import deliveries

    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = [m for m in a.pull(4, now=t) if m.queue_id == 0]
    assert a.ack([got[0].receipt_handle], now=t) == 1  # ended; the rest in flight
    b = broker.pull_consumer("workers", "b")
    later = t + broker.config.client_timeout_ms + 1
    taken = b.pull(3, now=later)  # a takeover of queue 0: a's rows revoked
    assert taken
    lite = PullConsumer(broker.warehouse.location, "workers", "c", clock=clock)
    clock.set(later + broker.config.client_timeout_ms + 1)
    mine = lite.pull(2)
    assert mine
    lite.nack([mine[0].receipt_handle])
    lite.close()
    wh = broker.warehouse
    whole = deliveries.summary(wh)
    assert whole and whole == deliveries._summary_by_engine(wh, None, None)
    assert any(s.taken_ts is not None for s in whole.values())
    assert any(s.due is not None for s in whole.values())
    assert any(s.old_hi is not None for s in whole.values())
    some = [("orders", 0), ("orders", 2)]
    assert deliveries.summary(wh, "workers", some) == deliveries._summary_by_engine(wh, "workers", some)


def _a_holds_queue_0_and_b_comes_later(broker, clock):
    """a pulls and acks q0m0, q0m1 (reserving queue 0 up to its head); b is a client that
    comes when a is silent past the client and lock timeouts by b's clock."""
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    first = [m for m in a.pull(2, now=t) if m.queue_id == 0]
    assert bodies(first) == ["q0m0", "q0m1"]
    assert a.ack([m.receipt_handle for m in first], now=t) == 2
    b = broker.pull_consumer("workers", "b")
    return t, a, b, t + broker.config.client_timeout_ms + broker.config.lock_queue_timeout_ms


def test_a_takeover_racing_a_pulls_fence_leaves_one_holder(pulled, clock, broker, monkeypatch):
    """The interleaving of the pull race: b (taking queue 0 over, its owner a silent past
    the lock timeout by b's clock) reads the lock row and the log, then a's pull runs
    whole (it hands out from its reservation, appends, and passes its fence), then b's
    compare-and-set commits. a's fence is itself a compare-and-set of the lock row, so
    b's commit no longer matches what b read: exactly one of them holds q0m2 and q0m3."""
    from deltamq import faults

    t, a, b, later = _a_holds_queue_0_and_b_comes_later(broker, clock)
    from_a: list = []
    real_point = faults.point

    def interleave(name: str) -> None:
        if name == "pull.before_lock_commit" and not from_a:
            from_a.append(None)  # once, and not for a's own pull inside it
            # a's pull read its clock before a pause: its reservation is young by it
            from_a.extend(m for m in a.pull(2, now=t + RESERVE_MS // 2 - 1) if m.queue_id == 0)
        real_point(name)

    monkeypatch.setattr(faults, "point", interleave)
    from_b = [m for m in b.pull(10, now=later) if m.queue_id == 0]
    monkeypatch.setattr(faults, "point", real_point)
    held_by_a = bodies(from_a[1:])
    assert held_by_a in (["q0m2", "q0m3"], []), held_by_a
    assert not set(held_by_a) & set(bodies(from_b)), (held_by_a, bodies(from_b))
    # whoever lost holds nothing: a's acks count only if a kept the queue
    assert a.ack([m.receipt_handle for m in from_a[1:]], now=later) == len(held_by_a)


def test_a_takeover_inside_a_pulls_fence_wins_and_the_pull_returns_nothing_from_it(
    pulled, clock, broker, monkeypatch
):
    """The other interleaving: a's fence has read its lock row when b's takeover commits
    whole; a's compare-and-set then misses, so a returns nothing from queue 0 and revokes
    what it appended, and b holds q0m2 onwards alone."""
    from deltamq import faults

    t, a, b, later = _a_holds_queue_0_and_b_comes_later(broker, clock)
    from_b: list = []
    real_point = faults.point

    def interleave(name: str) -> None:
        if name == "pull.before_fence_commit" and not from_b:
            from_b.append(None)
            from_b.extend(m for m in b.pull(10, now=later) if m.queue_id == 0)
        real_point(name)

    monkeypatch.setattr(faults, "point", interleave)
    from_a = [m for m in a.pull(2, now=t + RESERVE_MS // 2 - 1) if m.queue_id == 0]
    monkeypatch.setattr(faults, "point", real_point)
    assert from_a == []
    assert bodies(from_b[1:]) == ["q0m2", "q0m3", "q0m4"]
    assert b.ack([m.receipt_handle for m in from_b[1:]], now=later) == 3
    assert positions(broker.warehouse, "workers", [("orders", 0)]) == {("orders", 0): (5, 5)}


def test_the_files_and_the_engine_hand_out_the_same_rows(warehouse_with, clock):
    """deltamq/pull_reads.py reads from the tables' files when it can: the same rows,
    bodies and properties as the two engine statements, tag subscriptions applied."""
    from deltamq import file_reads, pull_reads

    broker = warehouse_with("orders", queues=2, group="workers", recorder=None, expression="A || B").broker
    tags = ["A", "B", "C", None]
    broker.producer("p").send_batch(
        [
            Message("orders", f"m{i}", tags=tags[i % 4], keys=f"k{i}", properties={"x": str(i)})
            for i in range(40)
        ]
    )
    broker.tick(clock.now_ms())
    ctx = broker.context
    cfg, subs = ctx.catalog.groups()["workers"], list(ctx.catalog.subscriptions("workers"))
    ranges = [("orders", 0, 0, 100), ("orders", 1, 3, 15)]
    columns = [*pull_reads.INDEX_COLUMNS, *pull_reads.BODY_COLUMNS]
    found = file_reads.handout_rows(ctx.warehouse, subs, ranges)
    assert found is not None and found.num_rows > 10
    files = found.select(columns).to_pylist()
    engine = (
        pull_reads._through_engine(ctx, "workers", cfg, subs, ranges, clock.now_ms())
        .select(columns)
        .to_pylist()
    )

    def key(r):
        return (r["queue_id"], r["queue_offset"])

    assert sorted(files, key=key) == sorted(engine, key=key)
    assert {r["tags"] for r in files} == {"A", "B"}
    assert all(dict(r["properties"])["x"] == r["body"].decode()[1:] for r in files)
    assert all(r["queue_offset"] >= 3 for r in files if r["queue_id"] == 1)


def test_an_offset_reset_restarts_the_pull_clients_there(pulled, clock, broker):
    """``reset_offsets`` on a pull group: the client holding the queues hands the messages
    out again from the new offset (it went on from where it was, and the replay was lost
    while the queue stalled), what it held in flight is revoked, and the fold keeps the
    new positions."""
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    first = a.pull(20, now=t)
    assert len(first) == 20
    a.ack([m.receipt_handle for m in first[:18]], now=t)  # two left in flight
    broker.tick(t + 1)  # folded: 18 acked
    clock.set(t + 2)
    new = broker.reset_offsets("workers", 0)
    assert {q: o for q, o in new.items() if q[0] == "orders"} == {("orders", q): 0 for q in range(4)}
    # revoked by the reset: an ack now may still be counted (the client's own recent handles
    # are acked without a read), but the messages are handed out again, at least once
    a.ack([m.receipt_handle for m in first[18:]], now=t + 2)
    again = a.pull(20, now=t + 3)
    assert sorted(bodies(again)) == sorted(bodies(first))  # every message once more, from offset 0
    assert a.ack([m.receipt_handle for m in again], now=t + 3) == 20
    broker.tick(t + 4)
    offsets = broker.sql(
        "SELECT queue_id, next_offset FROM offsets WHERE consumer_group = 'workers' AND topic = 'orders'"
    ).collect()
    assert sorted((r["queue_id"], r["next_offset"]) for r in offsets) == [(q, 5) for q in range(4)]
    assert a.pull(20, now=t + 5) == []
    clock.set(t + 6)
    broker.reset_offsets("workers", t + 10**9)  # forward, past every message
    assert a.pull(20, now=t + 7) == []


def test_an_offset_reset_reaches_a_busy_holder(pulled, clock, broker):
    """A holder in the middle of its reservation hands out without reading the lock rows,
    from its own position; when it next takes the lock it finds the queue released by the
    reset and starts again at the reset offset, revoking what it handed out since (it
    started where the log said it was, past the reset: queue 3's replay was lost)."""
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    first = a.pull(18, now=t)  # queues 0-2 whole, queue 3 up to m2; every queue reserved to its head
    assert len(first) == 18 and bodies(first)[-3:] == ["q3m0", "q3m1", "q3m2"]
    a.ack([m.receipt_handle for m in first], now=t)
    clock.set(t + 1)
    broker.reset_offsets("workers", 0)
    busy = a.pull(2, now=t + 2)  # inside its reservation: no lock read
    assert bodies(busy) == ["q3m3", "q3m4"]
    a.ack([m.receipt_handle for m in busy], now=t + 2)
    after: list[str] = []
    for i in range(8):
        now = t + 3 + i * RESERVE_MS
        got = a.pull(20, now=now)
        a.ack([m.receipt_handle for m in got], now=now)
        after += bodies(got)
    assert sorted(after) == sorted(f"q{q}m{i}" for q in range(4) for i in range(5))  # all again, once
    broker.tick(t + 9 * RESERVE_MS)
    offsets = broker.sql(
        "SELECT queue_id, next_offset FROM offsets WHERE consumer_group = 'workers' AND topic = 'orders'"
    ).collect()
    assert sorted((r["queue_id"], r["next_offset"]) for r in offsets) == [(q, 5) for q in range(4)]


def test_a_filtered_pull_hands_out_what_matches_beyond_its_batch_of_offsets(warehouse_with, clock):
    """A pull examined as many queue offsets as it could hand out messages: pull(32) of a
    tag matching 1 in 100 came back empty four times in five while matching messages
    waited, and a client stopping at an empty pull stopped early. A pull now examines
    further (twice as far each time, up to SCAN_LIMIT offsets), hands out at most its
    batch, and the next pull starts at the first message it left."""
    from deltamq import pull

    wh = warehouse_with("orders", queues=2, group=None)
    broker = wh.broker
    wh.add_group(None, name="rare", expression="rare")
    wh.add_group(None, name="half", expression="odd")
    tags = ["rare" if i % 100 == 99 else ("odd" if i % 2 else "even") for i in range(2000)]
    sent = [Message("orders", f"m{i}", tags=t) for i, t in enumerate(tags)]
    broker.producer("p").send_batch(sent)
    broker.tick(clock.now_ms())
    now = clock.now_ms()
    rare = broker.pull_consumer("rare", "c1")
    first = rare.pull(32, now=now)
    assert sorted(bodies(first)) == sorted(f"m{i}" for i in range(99, 2000, 100))  # all 20 at once
    assert rare.pull(32, now=now) == []  # none left: the answer is not "none in 32 offsets"

    half = broker.pull_consumer("half", "c1")
    seen: list[str] = []
    while got := half.pull(7, now=now):
        assert len(got) <= 7
        seen += bodies(got)
        half.ack([m.receipt_handle for m in got], now=now)
    expected = [f"m{i}" for i in range(2000) if i % 2 and i % 100 != 99]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))  # each once

    clock.advance(minutes=1)
    others = [Message("orders", f"x{i}", tags="even") for i in range(2 * pull.SCAN_LIMIT)]
    broker.producer("p").send_batch(others)
    broker.producer("p").send(Message("orders", "late", tags="rare"))
    broker.tick(clock.now_ms())
    scanned = [rare.pull(32, now=clock.now_ms()) for _ in range(3)]
    # at most SCAN_LIMIT offsets a call: the rare one past 40 000 others, in the third call at the latest
    assert [bodies(g) for g in scanned if g] == [["late"]]


def test_a_scan_whose_next_pull_fails_hands_out_what_it_has(warehouse_with, clock, caplog):
    """A pull call's later pulls of a scan failing used to drop the messages the earlier
    ones had handed out (in flight in the log: retried after the invisible time, a
    reconsume each). They are returned, with a warning naming the failure."""
    wh = warehouse_with("orders", queues=1, group=None)
    broker = wh.broker
    wh.add_group(None, name="half", expression="odd")
    broker.producer("p").send_batch(
        [Message("orders", f"m{i}", tags="odd" if i % 2 else "even") for i in range(40)]
    )
    broker.tick(clock.now_ms())
    client = broker.pull_consumer("half", "c1")
    real, calls = client.store.handout_rows, []

    def failing_later(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("the store went away")
        return real(*args, **kwargs)

    client.store.handout_rows = failing_later
    with caplog.at_level("WARNING"):
        got = client.pull(8, now=clock.now_ms())  # 8 offsets hold 4 odd ones: a second pull follows
    assert bodies(got) == ["m1", "m3", "m5", "m7"] and len(calls) == 2
    assert "the next pull failed: OSError: the store went away" in caplog.text
    client.store.handout_rows = real
    client.ack([m.receipt_handle for m in got], now=clock.now_ms())
    rest = client.pull(100, now=clock.now_ms())
    assert bodies(rest) == [f"m{i}" for i in range(9, 40, 2)]


def _created_again(broker, clock, *, deleted: bool = False) -> None:
    """Group "workers" deleted (unless ``deleted`` already) and, a second later, created
    again from the first offset of "orders"."""
    if not deleted:
        broker.delete_group("workers", force=True)
    clock.advance(seconds=1)
    broker.create_group("workers", consume_from="FIRST_OFFSET")
    broker.subscribe("workers", "orders")


def test_a_fold_across_a_group_deleted_and_created_again_leaves_the_new_group_at_its_start(
    pulled, clock, monkeypatch
):
    """The tick's fold read a pull group's acks, and before it wrote the acknowledged
    offsets the group was deleted and created again (FIRST_OFFSET): the fold put the new
    group where the old one had acked to, so the new group's clients got nothing. Now the
    fold writes positions only for groups as they were before it read the log."""
    from deltamq.jobs import pull_expiry

    broker = pulled
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(20, t)
    assert len(got) == 20 and a.ack([m.receipt_handle for m in got], t) == 20
    a.close(t)
    read_positions = pull_expiry.deliveries.read_positions

    def meanwhile(*args, **kwargs):  # the fold has read the log: the group goes and comes back
        monkeypatch.setattr(pull_expiry.deliveries, "read_positions", read_positions)
        _created_again(broker, clock)
        return read_positions(*args, **kwargs)

    monkeypatch.setattr(pull_expiry.deliveries, "read_positions", meanwhile)
    broker.tick(t + 1)
    fresh = broker.pull_consumer("workers", "b").pull(50, clock.now_ms())
    assert sorted(bodies(fresh)) == sorted(f"q{q}m{i}" for q in range(4) for i in range(5))


def test_a_group_created_again_ignores_the_pull_log_a_late_client_left(pulled, clock, tmp_path):
    """A pull client of a deleted group can append its handouts and write its locks after
    the delete (it reads the group again only every few seconds). The group created
    again under the name read those lock rows as its own: the queues stayed the old
    client's while its handouts were in flight, and the new clients got nothing. Such
    rows go when it is created."""
    broker = pulled
    t = clock.now_ms()
    got = broker.pull_consumer("workers", "a").pull(20, t)
    assert len(got) == 20
    tables = ("deliveries", "queue_lock")
    for t in tables:
        broker.sql(f"SELECT * FROM {t}").write.parquet(str(tmp_path / t))
    broker.delete_group("workers", force=True)
    for t in tables:  # written back as the late client would
        late = broker.engine.spark.read.parquet(str(tmp_path / t))
        late.write.format("delta").mode("append").save(broker.warehouse.uri(t))
    _created_again(broker, clock, deleted=True)
    fresh = broker.pull_consumer("workers", "b").pull(50, clock.now_ms())
    assert sorted(bodies(fresh)) == sorted(f"q{q}m{i}" for q in range(4) for i in range(5))


def test_a_fold_across_a_group_created_again_keeps_the_new_groups_log(pulled, clock, monkeypatch):
    """The group is deleted and created again while a fold runs, and the new group's
    client pulls and acks everything before the fold deletes the log rows below the
    old group's acknowledged offsets. That delete took the new group's acks with them,
    before any fold had written them: its messages were handed out again (a review's
    repro). The fold now leaves the rows of a group changed since it read the log."""
    from deltamq.jobs import pull_expiry

    broker = pulled
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(20, t)
    assert a.ack([m.receipt_handle for m in got], t) == 20
    a.close(t)
    read_positions = pull_expiry.deliveries.read_positions

    def meanwhile(*args, **kwargs):
        monkeypatch.setattr(pull_expiry.deliveries, "read_positions", read_positions)
        _created_again(broker, clock)
        b = broker.pull_consumer("workers", "b")
        again = b.pull(50, clock.now_ms())
        assert len(again) == 20 and b.ack([m.receipt_handle for m in again], clock.now_ms()) == 20
        b.close(clock.now_ms())
        return read_positions(*args, **kwargs)

    monkeypatch.setattr(pull_expiry.deliveries, "read_positions", meanwhile)
    broker.tick(t + 1)
    broker.tick(t + 2_000)
    broker.tick(t + 600_000)  # past every invisible time
    assert broker.pull_consumer("workers", "e").pull(50, t + 600_001) == []


def test_a_client_of_a_group_created_again_stops_instead_of_acking_into_the_new_one(pulled, clock):
    """A client still running when its group is deleted and created again saw a group
    by that name and went on: its acks became the new group's, which then skipped those
    messages (a review's repro). It reads the group again as before, and stops when the
    group there is not the one it joined."""
    from deltamq.errors import UnknownGroup

    broker = pulled
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(20, t)
    _created_again(broker, clock)
    later = t + broker.config.client_timeout_ms  # when the client reads its group again
    with pytest.raises(UnknownGroup, match="deleted and created again"):
        a.ack([m.receipt_handle for m in got], later)
    fresh = broker.pull_consumer("workers", "b").pull(50, later)
    assert sorted(bodies(fresh)) == sorted(f"q{q}m{i}" for q in range(4) for i in range(5))


def test_acks_a_late_client_appends_after_its_group_was_created_again_move_nothing(pulled, clock):
    """A client of the deleted group acks before it next reads its group (within a quarter
    of ``client_timeout_ms``): its ack rows land in the log under the name, for handouts
    the new group never made (create_group dropped them). Those acks moved the new
    group's position past the messages they named, which its clients never got. An ack
    of a handle the log holds no handout of now counts for nothing."""
    broker = pulled
    t = clock.now_ms()
    a = broker.pull_consumer("workers", "a")
    got = a.pull(20, t)
    _created_again(broker, clock)
    a.ack([m.receipt_handle for m in got], clock.now_ms())  # appended to the new group's log
    consumed = (
        "SELECT count(*) AS n FROM message_groups WHERE consumer_group = 'workers' AND state = 'consumed'"
    )
    assert broker.sql(consumed).collect()[0]["n"] == 0  # the view does not count them either
    broker.tick(clock.now_ms())
    fresh = broker.pull_consumer("workers", "b").pull(50, clock.now_ms())
    assert sorted(bodies(fresh)) == sorted(f"q{q}m{i}" for q in range(4) for i in range(5))
