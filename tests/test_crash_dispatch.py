"""Dispatch killed at every commit point and at random times: re-run loses and repeats nothing."""

from __future__ import annotations

import pytest
from support.crash import CrashRounds
from support.helpers import hint_matches_the_index

from deltamq import Message
from deltamq.constants import Prop
from deltamq.dq.conservation import check_dispatch

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

POINTS = [
    "dispatch.before_index_commit",
    "dispatch.after_index_commit",
    "dispatch.after_progress_commit",
]


def _produce(broker, clock, round_no: int) -> None:
    p = broker.producer("p")
    now = clock.now_ms()
    for k in range(3):
        p.send_batch(
            [
                Message(
                    "orders",
                    f"r{round_no}b{k}m{i}",
                    keys=f"{round_no}-{k}-{i}",
                    delay_level=(i % 4),
                    properties={Prop.TIMER_DELIVER_MS: str(now + 60_000)} if i == 7 else None,
                )
                for i in range(40)
            ]
        )
    df = broker.engine.spark.range(500).selectExpr("'orders' AS topic", "CAST(id AS STRING) AS body")
    p.send_dataframe(df)


def _check(broker, expected: int) -> None:
    report = check_dispatch(broker.warehouse)
    assert report.ok, report.describe()
    assert report.stored == report.indexed == expected
    hint_matches_the_index(broker)


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_dispatch_survives_kills(broker, clock, location, store_env):
    broker.create_topic("orders", queues=4)
    crashes = CrashRounds(location, POINTS, seed=20261123, env=store_env, random_rounds=3, want=8)
    expected = 0
    for round_no, (point, _) in enumerate(crashes):
        _produce(broker, clock, round_no)
        expected += 620
        clock.advance(seconds=1)
        crashes.kill_and_rerun("dispatch", clock.now_ms(), point)
        _check(broker, expected)
    assert crashes.kills >= 8
