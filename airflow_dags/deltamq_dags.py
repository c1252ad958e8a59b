"""deltamq on Airflow 3: three DAGs over one warehouse.

- ``deltamq_tick`` (every minute): one tick's jobs as tasks in order — dispatch →
  deliver → promote → dispatch again → deliver again → sink → check_transactions →
  retain — then ``data_quality`` (the Great Expectations suites and the conservation
  check), which fails the run on any violation.
- A failed job task (an error, or a push group whose listener — a sink whose transform —
  cannot be loaded where the task runs) stays red, and the tasks after it still run, as
  ``deltamq tick`` goes on past a group it cannot load: each job is idempotent and reads
  only what is committed. The last task, ``failed_jobs``, then fails the run, naming the
  failed tasks (Airflow decides a run's state by its last tasks alone).
- ``deltamq_loop`` (every minute): the tick loop for ``loop_seconds`` (55 s) at
  ``interval_seconds`` (1 s): second-level delays under a per-minute schedule.
- ``deltamq_tick_spark_submit`` (every minute): the same jobs, each submitted with
  ``spark-submit`` to a Spark Connect endpoint or a cluster (``spark_submit_args``), and
  the same ``failed_jobs`` task at the end (the entry exits 4 on a group it cannot load).

Where and how: DAG params ``warehouse``, ``engine`` (embedded | remote), ``remote``
(sc://host:port); an empty param falls back to the Airflow Variables
``deltamq_warehouse``, ``deltamq_engine``, ``deltamq_remote``, then to the environment.
Every task takes ``now`` from the wall clock, never the logical date; ``catchup=False``
and one active run per DAG. A job whose lease another runner holds (e.g. the loop DAG
while the tick DAG runs) is skipped and says so. At parse time this file imports only
Airflow, the standard library and ``deltamq.constants`` (the job list, no Spark); the rest
of deltamq and Spark load inside the tasks.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, Param, chain, get_current_context, task

from deltamq.constants import JOB_STEPS

# (task id, job kind) in the tick's order, from the one job list; a task runs every step
# under its job's lease, so the pull deliveries' expiry runs inside the deliver task
TICK_TASKS = tuple((step, lease) for step, lease in JOB_STEPS if step != "pull_expiry")

PARAMS = {
    "warehouse": Param(
        "", type="string", description="warehouse path or URI (else Variable deltamq_warehouse)"
    ),
    "engine": Param("", type="string", description="embedded | remote (else Variable deltamq_engine)"),
    "remote": Param("", type="string", description="Spark Connect URL for engine=remote"),
}


def _every_minute(dag_id: str, description: str, extra_params: dict | None = None) -> DAG:
    """A per-minute DAG: no catch-up, one active run."""
    return DAG(
        dag_id=dag_id,
        description=description,
        schedule=timedelta(minutes=1),
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        default_args={"retries": 0, "owner": "deltamq"},
        params={**PARAMS, **(extra_params or {})},
        tags=["deltamq"],
    )


def _settings():
    from airflow.sdk import Variable

    from deltamq.orchestration.runs import settings

    return settings(dict(get_current_context()["params"]), Variable)


def _skip_if(summary: dict) -> dict:
    if summary.get("status") == "skipped":
        from airflow.sdk.exceptions import AirflowSkipException

        raise AirflowSkipException(summary["reason"])
    if summary.get("status") == "failed":
        raise RuntimeError(summary["summary"])
    return summary


# every job task runs whatever became of the ones before it (a failed task stays red):
# the jobs are idempotent and read only what is committed
AFTER_ANY = "all_done"


def _job_task(task_id: str, job: str):
    @task(task_id=task_id, trigger_rule=AFTER_ANY)
    def run_one() -> dict:
        from deltamq.orchestration.runs import run_job

        return _skip_if(run_job(job, _settings()))

    return run_one()


def _failed_jobs(upstream: list) -> None:
    """The run's last task: runs only when a task before it failed, and fails the run
    naming them (a run whose last tasks succeeded is a success in Airflow, whatever failed
    before them)."""

    @task(task_id="failed_jobs", trigger_rule="one_failed")
    def failed_jobs() -> None:
        ti = get_current_context()["ti"]
        states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id, {})
        failed = sorted(t for t, state in states.items() if state == "failed")
        raise RuntimeError(f"failed in this run: {', '.join(failed) or 'a task before this one'}")

    done = failed_jobs()
    for t in upstream:
        t >> done


@task(task_id="data_quality", trigger_rule=AFTER_ANY)
def data_quality() -> dict:
    """The DQ suites and the conservation check: a violation fails the run."""
    from deltamq.orchestration.runs import run_quality

    if not get_current_context()["params"].get("data_quality", True):
        from airflow.sdk.exceptions import AirflowSkipException

        raise AirflowSkipException("data_quality=false for this run")
    summary = run_quality(_settings())
    if summary["status"] != "ok":
        raise RuntimeError(f"data quality failed: {summary['failures']}")
    return summary


with _every_minute(
    "deltamq_tick",
    "one deltamq tick, a task per job, then the data-quality check",
    {"data_quality": Param(True, type="boolean", description="run the DQ suites after the jobs")},
) as tick_dag:
    jobs = [_job_task(task_id, job) for task_id, job in TICK_TASKS]
    quality = data_quality()
    chain(*jobs, quality)
    _failed_jobs([*jobs, quality])


with _every_minute(
    "deltamq_loop",
    "the deltamq tick loop for most of each minute",
    {
        "loop_seconds": Param(55, type="number", minimum=1),
        "interval_seconds": Param(1, type="number", exclusiveMinimum=0),
    },
) as loop_dag:

    @task(task_id="tick_loop")
    def tick_loop() -> dict:
        from deltamq.orchestration.runs import run_loop

        params = get_current_context()["params"]
        return run_loop(
            _settings(), for_s=float(params["loop_seconds"]), interval_s=float(params["interval_seconds"])
        )

    tick_loop()


with _every_minute(
    "deltamq_tick_spark_submit",
    "one deltamq tick, each job submitted with spark-submit",
    {
        "spark_submit": Param("spark-submit", type="string", description="the spark-submit executable"),
        "spark_submit_args": Param(
            "",
            type="string",
            description="e.g. --remote sc://host:15002 --conf spark.api.mode=connect, or --master yarn "
            "--packages io.delta:delta-spark_2.13:4.0.1 --conf ... (deltamq spark conf prints them)",
        ),
    },
) as submit_dag:
    # the entry script's path is resolved on the worker, where deltamq is installed
    ENTRY = "$(python -c 'import deltamq.orchestration.submit as m; print(m.__file__)')"
    WAREHOUSE = "{{ params.warehouse or var.value.get('deltamq_warehouse', '') }}"
    ARGS = (
        "{{ params.spark_submit_args or ('--remote ' ~ (params.remote or var.value.get('deltamq_remote', ''))"
        " ~ ' --conf spark.api.mode=connect') }}"
    )
    submitted = [
        BashOperator(
            task_id=task_id,
            bash_command=(
                f'{{{{ params.spark_submit }}}} {ARGS} "{ENTRY}" {job} --warehouse "{WAREHOUSE}" '
                "--skipped-exit 99"
            ),
            skip_on_exit_code=99,
            trigger_rule=AFTER_ANY,
        )
        for task_id, job in TICK_TASKS
    ]
    chain(*submitted)
    _failed_jobs(submitted)
