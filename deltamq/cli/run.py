"""Commands that run the broker's jobs: ``tick`` (once, or ``--loop``) and ``job`` (one
job with its lease, e.g. under spark-submit)."""

from __future__ import annotations

import argparse
import os
import sys

from deltamq.cli.parser import now_arg

SKIPPED_EXIT = 3
"""Exit status of a one-shot tick or job whose lease another runner holds."""


def tick(broker, args: argparse.Namespace) -> int:
    from deltamq.errors import LeaseHeld

    if args.loop:
        return _loop(broker, args)
    _ready()
    try:
        result = broker.tick(now_arg(args.now))
    except LeaseHeld as e:
        print(f"skipped: {e}", file=sys.stderr)
        return SKIPPED_EXIT
    print(result.summary())
    return 0


def _loop(broker, args: argparse.Namespace) -> int:
    n = broker.runner.loop(
        args.interval,
        args.for_s,
        on_tick=lambda r: print(r.summary(), flush=True),
        on_wait=lambda e: print(f"waiting: {e}", flush=True),
    )
    print(f"stopped after {n} ticks")
    return 0


def job(broker, args: argparse.Namespace) -> int:
    from deltamq.errors import LeaseHeld
    from deltamq.orchestration.tick import TickRunner, job_sequence

    runner = TickRunner(broker, sequence=job_sequence(args.name))
    _ready()
    try:
        result = runner.tick(now_arg(args.now))
    except LeaseHeld as e:
        print(f"skipped: {e}", file=sys.stderr)
        return SKIPPED_EXIT
    finally:
        runner.release()
    print(result.summary(), flush=True)
    return 0


def _ready() -> None:
    """Say the broker is open and the job about to run (for a harness that kills jobs at
    random times: tests/crash.py sets DELTAMQ_READY_LINE)."""
    if os.environ.get("DELTAMQ_READY_LINE"):
        print("READY", flush=True)
