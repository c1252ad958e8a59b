"""The sink job killed at its commit points and at random times, ≥ 20 kills, each followed
by a replay from an earlier offset: every key is in the sink table once, with the value of
its latest message. Queue 0 gets most messages, so replayed passes merge older messages of
a key after newer ones (the replay guard decides)."""

from __future__ import annotations

from functools import partial

import pytest
from support.crash import CrashRounds

from deltamq.jobs import dispatch

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

POINTS = ["sink.before_merge_commit", "sink.after_merge_commit", "sink.after_offsets_commit"]
PER_ROUND = 40
KEYS = 100


def test_sink_is_exactly_once_under_kills(broker, clock, tmp_path, spark, warehouse_with):
    warehouse_with("orders", queues=4, group="lake", recorder=None, pull_batch_size=25)
    sink = broker.sink_to_table(
        "lake", str(tmp_path / "orders_sink"), ["order_id"], "support.listeners:order_rows"
    )
    crashes = CrashRounds(
        tmp_path / "wh", POINTS, seed=9, delay=(0.0, 0.4), each=2, random_rounds=4, want=12, most_random=16
    )
    rng = crashes.rng  # the batches' queues and the replays' start are drawn from it too
    producer = broker.producer("shop")
    latest: dict[str, int] = {}
    sent = 0
    times = []
    for round_no, (point, _) in enumerate(crashes):
        batch = {f"o{(round_no * 37 + i) % KEYS}": round_no * 1000 + i for i in range(PER_ROUND)}
        producer.send_dataframe(
            spark.createDataFrame(
                [("orders", k, str(v), rng.choice([0, 0, 0, 1, 2, 3])) for k, v in batch.items()],
                "topic string, keys string, body string, queue_id int",
            )
        )
        times.append(clock.now_ms())
        latest |= batch
        sent += len(batch)
        clock.advance(seconds=1)
        now = clock.now_ms()
        dispatch.run(broker.context, now)
        # pull_batch_size 25 per queue: a pass takes part of a round; the replay starts at
        # an earlier round and finishes everything
        since = rng.choice(times[-4:])
        replay = partial(_replay, sink, since, now)
        crashes.kill_and_rerun("sink", now, point, rerun=replay)
        rows = sink.read().collect()
        assert len(rows) == len({r["order_id"] for r in rows}), f"round {round_no}: a key twice"
        assert {r["order_id"]: r["amount"] for r in rows} == latest, (round_no, point)
        lag = broker.sql(
            "SELECT sum(next_offset) AS n FROM offsets WHERE consumer_group = 'lake' AND topic = 'orders'"
        ).collect()[0]["n"]
        assert lag == sent
    assert crashes.kills >= 12


def _replay(sink, since: int, now: int) -> None:
    sink.ctx.catalog.reset_offsets("lake", since)
    while sink.run(now).messages:
        pass
