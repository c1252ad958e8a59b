"""The single-machine broker: ``deltamq tick --loop``. Two runners on one warehouse never
run a job kind at the same time; SIGTERM stops a loop cleanly between jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deltamq import Message


def _loop(wh, *args: str) -> subprocess.Popen:
    env = {
        k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "DELTAMQ_RUNNER_ID")
    }
    env["RUST_LOG"] = "error"
    return subprocess.Popen(
        [sys.executable, "-m", "deltamq.cli", "tick", "--loop", "--warehouse", str(wh), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
def test_two_runners_never_run_a_job_kind_at_once(broker, tmp_path):
    broker.create_topic("orders", queues=2)
    broker.producer("p").send_batch([Message("orders", b"x")] * 5)
    wh = tmp_path / "wh"
    first = _loop(wh, "--interval", "0.2", "--for", "10")
    assert first.stdout.readline().startswith("tick ")  # the first holds the leases
    second = _loop(wh, "--interval", "0.2", "--for", "12")
    outs = [p.communicate(timeout=300) for p in (first, second)]
    for p, (_, err) in zip((first, second), outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "waiting: " in outs[1][0] and "held by" in outs[1][0]  # the second said why it waited
    runs = broker.sql(
        "SELECT job, holder, start_ts, end_ts FROM job_runs WHERE status = 'OK' ORDER BY start_ts"
    ).collect()
    holders = {r["holder"] for r in runs}
    assert len(holders) == 2, "the second runner took over once the first stopped"
    by_job: dict[str, list] = {}
    for r in runs:
        by_job.setdefault(r["job"], []).append(r)
    for job, rs in by_job.items():
        for a, b in zip(rs, rs[1:], strict=False):
            if a["holder"] != b["holder"]:
                assert b["start_ts"] >= a["end_ts"], (job, a, b)
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 5


def test_sigterm_stops_the_loop_cleanly(broker, tmp_path):
    wh = tmp_path / "wh"
    proc = _loop(wh, "--interval", "0.5")
    first = proc.stdout.readline()
    assert first.startswith("tick "), first
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped after" in out
    leases = broker.sql("SELECT job, expires_at FROM leases").collect()
    assert leases and all(r["expires_at"] == 0 for r in leases)  # given back on the way out
    # a new runner starts at once (nothing held)
    again = _loop(wh, "--interval", "0.5", "--for", "0.1")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and "waiting" not in out, (out, err[-2000:])


def test_a_runner_stopped_once_ticks_again(warehouse_with, clock):
    """A stop (SIGTERM, SIGINT, runner.stop()) ended the loop and stayed set: every later
    tick of that runner recorded each job SKIPPED ("stopping") and reported ok, and a later
    loop returned at once. A stop ends the loop it stops."""
    from support.listeners import read_log

    wh = warehouse_with("orders", queues=1, group="g")
    b = wh.broker
    runner = b.runner
    assert runner.loop(1.0, 30.0, on_tick=lambda result: runner.stop()) == 1
    b.producer("p").send(Message("orders", b"after the stop"))
    result = b.tick(clock.now_ms())
    assert [j.status for j in result.jobs if j.job in ("dispatch", "deliver")] == ["OK", "OK"]
    assert [c["body"] for c in read_log(wh.log)] == ["after the stop"]
    assert runner.loop(1.0, 3.0) >= 1
