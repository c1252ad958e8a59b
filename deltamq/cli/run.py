"""Commands that run the broker's jobs: ``tick`` (once, or ``--loop``) and ``job`` (one
job with its lease, e.g. under spark-submit).

A one-shot tick prints its tick line (``TickResult.summary``); with ``--json`` the tick as
one JSON document, and ``--loop --json`` one per tick (JSON Lines)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from deltamq.cli.format import json_line
from deltamq.cli.parser import OK, SETUP_FAILED, SKIPPED, UsageError, now_arg
from deltamq.errors import first_line

SKIPPED_EXIT = SKIPPED
"""Exit status of a one-shot tick or job whose lease another runner holds."""
SETUP_FAILED_EXIT = SETUP_FAILED
"""Exit status of a tick in which a push group consumed nothing because its listener could
not be loaded (an import error, say): its messages wait, nothing was retried."""


def tick(broker, args: argparse.Namespace) -> int:
    if args.loop:
        return _loop(broker, args)
    shaping = [
        o
        for o, given in (("--interval", args.interval), ("--for", args.for_s), ("--no-wake", not args.wake))
        if given
    ]
    if shaping:
        raise UsageError(
            f"{', '.join(shaping)} only shape a tick loop: add --loop, or leave them out for one tick"
        )
    return _once(broker.runner, args, release=False)


def job(broker, args: argparse.Namespace) -> int:
    from deltamq.orchestration.tick import TickRunner, job_sequence

    return _once(TickRunner(broker.context, sequence=job_sequence(args.name)), args, release=True, skips=True)


def _once(runner, args: argparse.Namespace, *, release: bool, skips: bool = False) -> int:
    from deltamq.errors import LeaseHeld

    now = now_arg(args.now)
    _ready()
    try:
        result = runner.tick(now)
    except LeaseHeld as e:
        print(f"skipped: {e}", file=sys.stderr, flush=True)
        if args.json:
            print(json_line({"skipped": str(e), "exit_status": SKIPPED_EXIT}), flush=True)
        return SKIPPED_EXIT
    finally:
        if release:
            runner.release()
    _show(result, args, skips=skips)
    return SETUP_FAILED_EXIT if result.setup_errors else OK


def _show(result, args: argparse.Namespace, *, skips: bool = False) -> None:
    """The tick line (or its JSON; ``skips``: the jobs skipped named with the reason), then
    each push group whose listener could not be loaded, loudly, on stderr."""
    print(json_line(tick_data(result)) if args.json else result.summary(skips=skips), flush=True)
    for group, why in result.setup_errors:
        print(f"deltamq: error: group {group!r} consumed nothing: {why}", file=sys.stderr, flush=True)


def tick_data(result) -> dict[str, Any]:
    """A TickResult as the JSON document ``tick --json`` prints."""
    return {
        "tick_id": result.tick_id,
        "now": result.now,
        "ok": result.ok,
        "idle": result.idle,
        "holder": result.holder,
        "jobs": [
            {
                "job": j.job,
                "status": j.status,
                "rows_in": j.rows_in,
                "rows_out": j.rows_out,
                "ms": j.end_ts - j.start_ts,
                "error": j.error,
                "note": j.note,
                "details": j.details,
            }
            for j in result.jobs
        ],
        "groups": dict(result.group_lines()),
        "setup_errors": [{"group": g, "why": why} for g, why in result.setup_errors],
    }


def _loop(broker, args: argparse.Namespace) -> int:
    if args.now:
        raise UsageError("--now is for one tick; the loop ticks at the broker's clock")

    waits = failed = 0

    def waiting(e: Exception) -> None:
        nonlocal waits
        waits += 1
        print(json_line({"waiting": str(e)}) if args.json else f"waiting: {e}", flush=True)

    def failing(e: Exception) -> None:  # recorded in job_runs; the loop goes on
        nonlocal failed
        failed += 1
        why = f"{type(e).__name__}: {first_line(e)}"
        print(json_line({"ok": False, "failed": why}) if args.json else f"tick failed: {why}", flush=True)

    n = broker.runner.loop(
        1.0 if args.interval is None else args.interval,
        args.for_s,
        on_tick=lambda result: _show(result, args),
        on_wait=waiting,
        on_error=failing,
        wake_at_due=args.wake,
    )
    waited = f", {waits} times waited for another runner's lease" if waits else ""
    failures = f", {failed} of them failed" if failed else ""
    print(
        json_line({"stopped_after_ticks": n, "failed": failed, "waits": waits})
        if args.json
        else f"stopped after {n} ticks{failures}{waited}",
        flush=True,
    )
    return OK


def _ready() -> None:
    """Say the broker is open and the job about to run (for a harness that kills jobs at
    random times: tests/support/crash.py sets DELTAMQ_READY_LINE)."""
    if os.environ.get("DELTAMQ_READY_LINE"):
        print("READY", flush=True)
