"""Running jobs from a scheduler (the Airflow DAGs in ``airflow_dags/``, cron, scripts).

Each call opens the warehouse with the engine asked for, runs one job kind (with its
lease) or the tick loop for a bounded time, gives the leases back and returns a small
JSON-friendly summary. ``now`` is always the wall clock at the call, never a
scheduler's logical date. A job whose lease another runner holds is not run: the
summary says ``skipped`` and who holds it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from deltamq.errors import ConfigError, LeaseHeld

ENGINES = ("embedded", "remote")


@dataclass(frozen=True)
class Settings:
    warehouse: str
    engine: str = "embedded"
    remote: str | None = None


log = logging.getLogger(__name__)


def settings(params: dict[str, Any] | None = None, variables: Any = None) -> Settings:
    """Where and how to run: DAG params first, then Airflow Variables (``variables.get``:
    ``deltamq_warehouse``, ``deltamq_engine``, ``deltamq_remote``), then the environment
    (``DELTAMQ_WAREHOUSE``, ``DELTAMQ_ENGINE``, ``DELTAMQ_SPARK_REMOTE``, as the CLI)."""
    params = params or {}

    env = {"warehouse": "DELTAMQ_WAREHOUSE", "engine": "DELTAMQ_ENGINE", "remote": "DELTAMQ_SPARK_REMOTE"}

    def pick(name: str, default: str | None = None) -> str | None:
        value = params.get(name)
        if not value and variables is not None:
            value = variables.get(f"deltamq_{name}", default=None)
        return value or os.environ.get(env[name]) or default

    warehouse = pick("warehouse")
    if not warehouse:
        raise ConfigError(
            "no warehouse given: set the DAG param 'warehouse', the Airflow Variable 'deltamq_warehouse' "
            "or DELTAMQ_WAREHOUSE"
        )
    remote = pick("remote")
    # a Spark Connect URL alone means the remote engine, as for the CLI and BrokerConfig
    engine = pick("engine", "remote" if remote else "embedded")
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} is not allowed; use one of {ENGINES}")
    if engine == "remote" and not remote:
        raise ConfigError("engine='remote' needs a Spark Connect URL (param 'remote', e.g. sc://host:15002)")
    return Settings(warehouse, engine, remote if engine == "remote" else None)


def _open(s: Settings):
    from deltamq.broker import Broker

    return Broker.open(s.warehouse, remote=s.remote)


def run_job(job: str, s: Settings) -> dict[str, Any]:
    """One job kind (``dispatch``, ``promote``, ``deliver``, ``sink``,
    ``check_transactions``) or ``tick`` (all of them), at the wall clock."""
    from deltamq.orchestration.tick import JOB_NAMES, SEQUENCE, TickRunner, job_sequence

    if job != "tick" and job not in JOB_NAMES:
        raise ConfigError(f"job={job!r} is not allowed; use one of {(*JOB_NAMES, 'tick')}")
    broker = _open(s)
    runner = TickRunner(broker.context, sequence=SEQUENCE if job == "tick" else job_sequence(job))
    try:
        result = runner.tick()
    except LeaseHeld as e:
        return {"job": job, "status": "skipped", "reason": str(e)}
    finally:
        runner.release()
    summary = {
        "job": job,
        # a push group whose listener (a sink whose transform) could not be loaded consumed
        # nothing: a failed task
        "status": "ok" if result.ok and not result.setup_errors else "failed",
        "now": result.now,
        "summary": result.summary(),
        "steps": {
            j.job: {"status": j.status, "in": j.rows_in, "out": j.rows_out, "note": j.note}
            for j in result.jobs
        },
    }
    if result.setup_errors:
        summary["summary"] = f"{result.summary()} — " + "; ".join(
            f"group {g!r} consumed nothing ({why}); its messages wait" for g, why in result.setup_errors
        )
    log.info("%s", result.summary())
    if job != "tick" and result.jobs and all(j.status == "SKIPPED" for j in result.jobs):
        # an Airflow task shows it as skipped, with the reason
        notes = "; ".join(f"{j.job}: {j.note or 'nothing to do'}" for j in result.jobs)
        summary |= {"status": "skipped", "reason": notes}
    return summary


def _step(j: Any) -> dict[str, Any]:
    return {"status": j.status, "in": j.rows_in, "out": j.rows_out, "note": j.note}


def run_loop(s: Settings, *, for_s: float, interval_s: float = 1.0) -> dict[str, Any]:
    """The tick loop for ``for_s`` seconds (second-level delays under a per-minute
    schedule); stops early and cleanly on SIGTERM."""
    broker = _open(s)
    waits: list[str] = []
    try:
        ticks = broker.runner.loop(interval_s, for_s, on_wait=lambda e: waits.append(str(e)))
    finally:
        broker.runner.release()
    return {
        "status": "ok",
        "ticks": ticks,
        "waited": len(waits),
        "last_wait": waits[-1] if waits else None,
    }


def run_quality(s: Settings) -> dict[str, Any]:
    """The data-quality suites and the conservation check (recorded in ``dq_results``)."""
    broker = _open(s)
    result = broker.check_quality()
    log.info(
        "data quality: %d expectations, %d failed (run %s, recorded in dq_results)",
        len(result.results),
        len(result.failures),
        result.run_id,
    )
    for r in result.failures:
        log.warning("data quality: %s / %s: %s unexpected", r.suite, r.expectation, r.unexpected_count)
    return {
        "status": "ok" if result.success else "failed",
        "run_id": result.run_id,
        "expectations": len(result.results),
        "failures": [
            {
                "suite": r.suite,
                "expectation": r.expectation,
                "unexpected": r.unexpected_count,
                "sample": list(r.sample_ids[:5]),
            }
            for r in result.failures
        ],
    }
