"""Promote killed at every commit point and at random times: each due message is promoted
exactly once."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.crash import CrashRounds
from support.helpers import hint_matches_the_index

from deltamq import Message
from deltamq.dq.conservation import check_dispatch
from deltamq.jobs import dispatch

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

POINTS = ["promote.before_output_commit", "promote.after_output_commit", "promote.after_progress_commit"]


def test_promote_survives_kills(broker, clock, tmp_path):
    broker.create_topic("orders", queues=4)
    crashes = CrashRounds(tmp_path / "wh", POINTS, seed=5, delay=(0.0, 0.4), random_rounds=3, want=8)
    sent = 0
    p = broker.producer("p")
    for round_no, (point, _) in enumerate(crashes):
        batch = [Message("orders", f"r{round_no}d{i}", delay_level=1 + i % 2) for i in range(30)]
        batch += [
            Message("orders", f"r{round_no}t{i}", delay=timedelta(milliseconds=700 + i)) for i in range(10)
        ]
        p.send_batch(batch)
        sent += len(batch)
        dispatch.run(broker.context, clock.now_ms())
        clock.advance(seconds=6)  # everything of this round is due
        now = clock.now_ms()
        crashes.kill_and_rerun("promote", now, point)
        dispatch.run(broker.context, now)
        report = check_dispatch(broker.warehouse)
        assert report.ok, report.describe()
        real = broker.sql(
            "SELECT count(*) AS n, count(DISTINCT properties['UNIQ_KEY']) AS uniq FROM consume_queue "
            "WHERE topic = 'orders'"
        ).collect()[0]
        assert real["n"] == real["uniq"] == sent, (round_no, real)
    assert crashes.kills >= 8


TICK_POINTS = [
    "promote.after_output_commit",
    "promote.after_index_commit",
    "promote.after_progress_commit",
    "dispatch.after_index_commit",
]


def test_promote_indexing_its_copies_in_a_tick_survives_kills(broker, clock, tmp_path):
    """In a tick promote indexes its copies itself (no second dispatch): killed before,
    between or after its index and progress commits (or the tick's next dispatch), every
    copy is indexed once, offsets stay dense and dispatch's hint matches the index."""
    broker.create_topic("orders", queues=4)
    crashes = CrashRounds(tmp_path / "wh", TICK_POINTS, seed=7, delay=(0.0, 1.5), random_rounds=3, want=7)
    sent = 0
    p = broker.producer("p")
    for round_no, (point, _) in enumerate(crashes):
        batch = [Message("orders", f"r{round_no}d{i}", delay_level=1 + i % 2) for i in range(30)]
        batch += [
            Message("orders", f"r{round_no}t{i}", delay=timedelta(milliseconds=700 + i)) for i in range(10)
        ]
        p.send_batch(batch)
        sent += len(batch)
        dispatch.run(broker.context, clock.now_ms())
        clock.advance(seconds=6)  # everything of this round is due
        now = clock.now_ms()
        if point == "dispatch.after_index_commit":
            p.send(Message("orders", f"r{round_no}plain"))  # the tick's first dispatch has work
            sent += 1
        crashes.kill_and_rerun("tick", now, point)
        report = check_dispatch(broker.warehouse)
        assert report.ok, report.describe()
        real = broker.sql(
            "SELECT count(*) AS n, count(DISTINCT properties['UNIQ_KEY']) AS uniq FROM consume_queue "
            "WHERE topic = 'orders'"
        ).collect()[0]
        assert real["n"] == real["uniq"] == sent, (round_no, real)
        hint_matches_the_index(broker, round_no)
    assert crashes.kills >= 7
