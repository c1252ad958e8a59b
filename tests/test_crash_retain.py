"""The retain job killed at its commit points and at random times, then run again: the
index stays dense, every remaining index row keeps its body, no group is left behind a
queue minimum, and the data-quality suites pass."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.crash import CrashRounds

from deltamq import Message
from deltamq.dq.suites import run as check
from deltamq.jobs import dispatch, promote, retain

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

POINTS = ["retain.after_index_commit", "retain.after_offsets_commit", "retain.after_bodies_commit"]
DAY = 86_400_000


def test_retain_survives_kills(broker, clock, tmp_path, warehouse_with):
    warehouse_with("orders", queues=2, group="idle", recorder=None)  # never consumes: skips forward
    crashes = CrashRounds(
        tmp_path / "wh", POINTS, seed=12, delay=(0.0, 1.0), each=1, random_rounds=2, want=4, most_random=6
    )
    p = broker.producer("shop")
    for day in range(3):  # history: from the first round on, every pass has a day to drop
        p.send_batch([Message("orders", f"h{day}-{i}".encode()) for i in range(20)])
        dispatch.run(broker.context, clock.now_ms())
        clock.advance(timedelta(days=1))
    retain.run(broker.context, clock.now_ms(), force=True)  # the first pass: later ones are due daily here
    dropped = 0
    for round_no, (point, _) in enumerate(crashes):
        p.send_batch([Message("orders", f"r{round_no}-{i}".encode()) for i in range(20)])
        p.send(Message("orders", b"timer", delay=timedelta(days=2)))
        now = clock.now_ms()
        dispatch.run(broker.context, now)
        promote.run(broker.context, now)
        dispatch.run(broker.context, now)
        clock.advance(timedelta(days=1))
        now = clock.now_ms()
        crashes.kill_and_rerun(
            "retain", now, point, rerun=lambda n=now: retain.run(broker.context, n, force=True)
        )
        dropped += retain.run(broker.context, now, force=True).index_rows  # a further pass: nothing left
        orphans = broker.sql(
            "SELECT count(*) AS n FROM consume_queue q LEFT ANTI JOIN commit_log c "
            "ON c.batch_id = q.cl_batch_id AND c.batch_pos = q.cl_batch_pos AND c.msg_id = q.msg_id"
        ).collect()[0]["n"]
        assert orphans == 0, f"round {round_no}: index rows without a body"
        cut = now - broker.config.file_reserved_time_ms
        stale = broker.sql(
            f"SELECT count(*) AS n FROM consume_queue WHERE topic = 'orders' AND store_ts < {cut}"
        ).collect()[0]["n"]
        assert stale == 0, f"round {round_no}: expired messages still indexed"
        result = check(broker.context, tables=["consume_queue", "offsets"], record=False)
        assert result.success, [(r.expectation, r.sample_ids) for r in result.failures]
    assert crashes.kills >= 4 and dropped == 0
    remaining = broker.sql("SELECT min(store_ts) AS t FROM consume_queue WHERE topic = 'orders'").collect()
    assert remaining[0]["t"] >= clock.now_ms() - broker.config.file_reserved_time_ms
