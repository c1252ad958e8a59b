"""Deliver killed at every commit point and at random times: afterwards every message is
consumed (none lost), and any message handed over twice was in flight at a kill."""

from __future__ import annotations

from collections import Counter

import pytest
from support.crash import CrashRounds, run_job
from support.listeners import read_log

from deltamq import Message
from deltamq.jobs import dispatch

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

POINTS = [
    "deliver.after_attempt_commit",
    "deliver.after_listener",
    "deliver.after_sendback_commit",
    "deliver.after_offsets_commit",
]


def test_deliver_survives_kills(broker, clock, tmp_path):
    broker.create_topic("orders", queues=4)
    broker.create_group("g", "support.listeners:env_fail_odd", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    wh, log = tmp_path / "wh", tmp_path / "calls.jsonl"
    crashes = CrashRounds(wh, POINTS, seed=7, delay=(0.1, 1.2), random_rounds=2)
    killed_runs, sent = set(), []
    p = broker.producer("p")
    for round_no, (point, _) in enumerate(crashes):
        sent += p.send_batch([Message("orders", f"r{round_no}m{i}") for i in range(12)])
        dispatch.run(broker.context, clock.now_ms())
        clock.advance(seconds=1)
        run = f"round{round_no}"
        env = {"DELTAMQ_TEST_LOG": str(log), "DELTAMQ_TEST_RUN": run}
        rerun_env = {**env, "DELTAMQ_TEST_RUN": run + "-rerun"}
        outcome = crashes.kill_and_rerun("deliver", clock.now_ms(), point, env=env, rerun_env=rerun_env)
        if outcome.killed:
            killed_runs.add(run)
    # let every retry fall due and be consumed (a full tick: dispatch, promote, deliver)
    for step in range(3):
        clock.advance(minutes=1)
        env = {"DELTAMQ_TEST_LOG": str(log), "DELTAMQ_TEST_RUN": f"final{step}"}
        done = run_job(wh, "tick", clock.now_ms(), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    calls = read_log(log)
    consumed = {c["id"] for c in calls if c["reconsume"] > 0 or c["body"][-1] not in "13579"}
    assert set(sent) <= consumed, f"lost: {sorted(set(sent) - consumed)[:5]}"
    handed = Counter((c["id"], c["reconsume"]) for c in calls)
    for (mid, reconsume), n in handed.items():
        if n > 1:
            runs = {c["run"] for c in calls if c["id"] == mid and c["reconsume"] == reconsume}
            assert runs & killed_runs, f"{mid} handed over {n} times without a kill: {runs}"
    dead = broker.sql("SELECT count(*) AS n FROM commit_log WHERE topic = '%DLQ%g'").collect()[0]["n"]
    assert dead == 0
    assert crashes.kills >= 10
