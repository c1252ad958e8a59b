"""The Airflow DAGs (airflow_dags/): they import cleanly and light, and a ``dag.test()``
of the tick DAG on the embedded engine moves a message from send to consumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.listeners import read_log

from deltamq import Message

DAGS = Path(__file__).resolve().parent.parent / "airflow_dags"
TESTS = Path(__file__).resolve().parent

_BAG = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
light = ("deltamq", "deltamq.constants")  # the job list: the standard library only
roots = ("pyspark", "pysail", "pyarrow", "deltamq")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in roots and m not in light)
dags = {d: [t.task_id for t in bag.get_dag(d).topological_sort()] for d in sorted(bag.dag_ids)}
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": dags, "heavy": heavy}))
"""

_TEST = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
run = bag.get_dag(sys.argv[2]).test(run_conf=json.loads(sys.argv[3]))
tasks = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
print(json.dumps({"state": str(run.state), "tasks": tasks}))
"""


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow_home")
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(DAGS),
        AIRFLOW__LOGGING__LOGGING_LEVEL="WARNING",
        RUST_LOG="error",
        PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
    )
    airflow = Path(sys.executable).parent / "airflow"
    out = subprocess.run(
        [str(airflow), "db", "migrate"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return env


def _python(script: str, *args: str, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-5000:])
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"output": out.stdout + out.stderr}


def test_the_dags_import_without_errors_and_without_spark(airflow_env):
    bag = _python(_BAG, str(DAGS), env=airflow_env)
    assert bag["errors"] == {}
    assert bag["heavy"] == []  # nothing heavy at parse time: of deltamq, only its job list
    jobs = [
        *("dispatch", "deliver", "promote", "redispatch", "redeliver"),
        *("sink", "check_transactions", "retain"),
    ]
    assert bag["dags"] == {
        "deltamq_loop": ["tick_loop"],
        "deltamq_tick": [*jobs, "data_quality", "failed_jobs"],
        "deltamq_tick_spark_submit": [*jobs, "failed_jobs"],
    }


@pytest.mark.slow
@pytest.mark.spark  # also on Apache Spark's Connect server: DELTAMQ_SPARK_REMOTE alone points the DAG there
def test_the_tick_dag_moves_a_message_from_send_to_consumed(airflow_env, broker, tmp_path, env_listener_log):
    log = env_listener_log  # where support.listeners:env_recorder writes, wherever the engine runs it
    broker.create_topic("orders", queues=2)
    broker.create_group("billing", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    mid = broker.producer("shop").send(Message("orders", b"order-1"))
    env = dict(airflow_env, DELTAMQ_TEST_LOG=str(log))
    run = _python(_TEST, str(DAGS), "deltamq_tick", json.dumps({"warehouse": str(tmp_path / "wh")}), env=env)
    assert run["state"] == "success"
    assert [(c["id"], c["body"]) for c in read_log(log) if c["id"] == mid] == [(mid, "order-1")]
    offsets = broker.sql(
        "SELECT sum(next_offset) AS n FROM offsets WHERE consumer_group = 'billing' AND topic = 'orders'"
    ).collect()
    assert offsets[0]["n"] == 1
    runs = {r["job"]: r["status"] for r in broker.sql("SELECT job, status FROM job_runs").collect()}
    assert {"dispatch", "promote", "deliver", "check_transactions", "sink", "retain"} <= set(runs)
    # what the tick records as skipped (no sink group, no half message, retention not due)
    # Airflow shows as skipped, and the sink task's run is in job_runs too
    assert (runs["sink"], runs["check_transactions"], runs["retain"]) == ("SKIPPED",) * 3
    tasks = run["tasks"]
    assert (tasks["sink"], tasks["check_transactions"], tasks["retain"]) == ("skipped",) * 3
    assert tasks["deliver"] == tasks["dispatch"] == tasks["data_quality"] == "success"
    assert tasks["failed_jobs"] == "skipped"  # nothing failed


@pytest.mark.slow
def test_a_group_that_cannot_load_fails_the_run_and_the_later_jobs_still_run(
    airflow_env, broker, tmp_path, env_listener_log, monkeypatch
):
    """As ``deltamq tick`` goes on past a group whose listener cannot be loaded (and exits
    4), the DAG's later tasks run, the group's own task stays red, and the run fails."""
    log = env_listener_log
    (tmp_path / "only_here.py").write_text("def ok(messages, context):\n    return 'CONSUME_SUCCESS'\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here, not where the DAG's tasks run
    broker.create_topic("orders", queues=1)
    broker.create_group("billing", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
    broker.create_group("broken", "only_here:ok", consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    broker.subscribe("broken", "orders")
    mid = broker.producer("shop").send(Message("orders", b"order-1"))
    env = dict(airflow_env, DELTAMQ_TEST_LOG=str(log))
    run = _python(_TEST, str(DAGS), "deltamq_tick", json.dumps({"warehouse": str(tmp_path / "wh")}), env=env)
    tasks = run["tasks"]
    assert run["state"] == "failed"
    assert tasks["deliver"] == "failed"  # the group's own task, red
    # every later task ran (none upstream_failed), then the last one failed the run
    assert {t: s for t, s in tasks.items() if s not in ("success", "skipped", "failed")} == {}
    assert tasks["data_quality"] == "success" and tasks["failed_jobs"] == "failed"
    assert "failed in this run: deliver" in run["output"]  # the last task names the red one
    assert [c["id"] for c in read_log(log)] == [mid]  # billing's, once
    waiting = broker.sql(
        "SELECT consumer_group, next_offset FROM offsets WHERE topic = 'orders' "
        "AND consumer_group IN ('billing', 'broken') ORDER BY consumer_group"
    ).collect()
    assert [(r["consumer_group"], r["next_offset"]) for r in waiting] == [("billing", 1), ("broken", 0)]


@pytest.mark.slow
def test_the_spark_submit_dag_runs_each_job_with_spark_submit(airflow_env, broker, tmp_path):
    from deltamq.sail import EmbeddedServer as _EmbeddedServer

    broker.create_topic("orders", queues=2)
    broker.producer("shop").send_batch([Message("orders", b"a"), Message("orders", b"b")])
    bindir = Path(sys.executable).parent
    env = dict(airflow_env, PATH=f"{bindir}:{airflow_env['PATH']}", PYSPARK_PYTHON=sys.executable)
    conf = {
        "warehouse": str(tmp_path / "wh"),
        "spark_submit_args": f"--remote {_EmbeddedServer.url()} --conf spark.api.mode=connect",
    }
    run = _python(_TEST, str(DAGS), "deltamq_tick_spark_submit", json.dumps(conf), env=env)
    assert run["state"] == "success"
    assert broker.sql("SELECT count(*) AS n FROM consume_queue WHERE topic = 'orders'").collect()[0]["n"] == 2
    holders = broker.sql("SELECT DISTINCT job FROM job_runs").collect()
    assert {"dispatch", "promote", "deliver", "check_transactions"} <= {r["job"] for r in holders}


@pytest.mark.slow
def test_the_tick_dag_fails_on_a_data_quality_violation(airflow_env, broker, tmp_path):
    broker.create_topic("orders", queues=1)
    broker.producer("shop").send_batch([Message("orders", b"a"), Message("orders", b"b")])
    broker.tick()
    broker.create_group("billing")  # LAST_OFFSET: its offset row starts at 2
    broker.subscribe("billing", "orders")
    offsets = broker.warehouse.ref("offsets")
    broker.sql(f"UPDATE {offsets} SET next_offset = 7 WHERE consumer_group = 'billing'", write=True).collect()
    conf = json.dumps({"warehouse": str(tmp_path / "wh")})
    run = _python(_TEST, str(DAGS), "deltamq_tick", conf, env=airflow_env)
    assert run["state"] == "failed"
    failed = broker.sql("SELECT expectation, sample_ids FROM dq_results WHERE NOT success").collect()
    assert [(r["expectation"], r["sample_ids"]) for r in failed] == [
        ("group offsets within [min, max + 1]", ["billing orders:0 next_offset=7"])
    ]


@pytest.mark.unit
def test_a_spark_connect_url_alone_points_the_tasks_at_it(monkeypatch):
    """DELTAMQ_SPARK_REMOTE (or the param or Variable 'remote') without an engine means the
    remote engine, as for the CLI: the tasks must not quietly run on embedded Sail."""
    from deltamq.orchestration.runs import settings

    monkeypatch.delenv("DELTAMQ_ENGINE", raising=False)
    monkeypatch.setenv("DELTAMQ_SPARK_REMOTE", "sc://spark-host:15002")
    got = settings({"warehouse": "/lake/wh"})
    assert (got.engine, got.remote) == ("remote", "sc://spark-host:15002")
    assert settings({"warehouse": "/lake/wh", "engine": "embedded"}).engine == "embedded"  # said: kept
    monkeypatch.delenv("DELTAMQ_SPARK_REMOTE")
    assert (settings({"warehouse": "/lake/wh"}).engine, settings({"warehouse": "/lake/wh"}).remote) == (
        "embedded",
        None,
    )
