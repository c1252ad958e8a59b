"""The Apache Spark guard (runs last).

(a) Every SQL statement the engine issued during this test session is parsed by
Apache Spark's own parser; (b) the pure plan-function tests (marker ``plan``) run
again on a classic local Apache Spark session. Both in subprocesses: one engine kind
per process (docs/design.md, measured facts). It needs no Delta jars, so it runs in the slow
tier on every machine; the Spark tiers (``--engine spark``) run every job on Apache Spark
with Delta itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECORDED_SQL, recorded_sql_file

from deltamq import Broker, FakeClock, Message

HERE = Path(__file__).parent


def classic_env(**extra: str) -> dict[str, str]:
    """The environment for a classic-Spark child: pyspark marks the process as Spark
    Connect (SPARK_CONNECT_MODE_ENABLED) once a remote session exists; drop that."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
    env.update(extra)
    return env


def _workload(path: Path) -> None:
    """Make sure the common statements are recorded even when this test runs alone."""
    b = Broker.init(path, clock=FakeClock())
    b.create_topic("t", exist_ok=True)
    b.create_group("g", exist_ok=True)
    b.subscribe("g", "t", "A || B")
    b.producer("p").send_batch([Message("t", b"x", delay_level=2), Message("t", b"y")])
    b.tick()
    b.status()
    b.update_topic("t", queues=8)
    b.delete_group("g", force=True)
    b.delete_topic("t", force=True)
    b.close()


@pytest.mark.slow
@pytest.mark.spark_guard
def test_every_recorded_statement_parses_with_apache_spark(tmp_path, request):
    """Parses what this run recorded and what earlier runs (the default tier) left in the
    shared file; the file is emptied once they all parse."""
    _workload(tmp_path / "wh")
    shared = recorded_sql_file(request.config)
    earlier = set()
    if shared is not None and shared.exists():
        earlier = {json.loads(line) for line in shared.read_text(encoding="utf-8").splitlines() if line}
    statements = sorted(RECORDED_SQL | earlier)
    assert len(statements) > 20
    kinds = {s.split()[0].upper() for s in statements}
    assert {"SELECT", "MERGE", "DELETE"} <= kinds, kinds
    path = tmp_path / "statements.json"
    path.write_text(json.dumps(statements))
    out = subprocess.run(
        [sys.executable, str(HERE / "support" / "spark_guard_parse.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=classic_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failed"] == [], json.dumps(report["failed"][:5], indent=1)
    assert report["parsed"] == len(statements)
    if shared is not None:  # all parsed: neither this run's nor earlier runs' need keeping
        shared.write_text("")
        RECORDED_SQL.clear()


@pytest.mark.slow
@pytest.mark.spark_guard
def test_plan_functions_on_classic_apache_spark():
    env = classic_env(DELTAMQ_TEST_ENGINE="classic")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "plan", "-p", "no:cacheprovider", str(HERE)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=HERE.parent,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
