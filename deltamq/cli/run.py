"""Commands that run the broker's jobs: ``tick`` (once, or ``--loop``) and ``job`` (one
job with its lease, e.g. under spark-submit)."""

from __future__ import annotations

import argparse
import os
import sys

from deltamq.cli.parser import now_arg

SKIPPED_EXIT = 3
"""Exit status of a one-shot tick or job whose lease another runner holds."""
SETUP_FAILED_EXIT = 4
"""Exit status of a tick in which a push group consumed nothing because its listener could
not be loaded (an import error, say): its messages wait, nothing was retried."""


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
    return _say_setup_errors(result)


def _say_setup_errors(result) -> int:
    """Loudly, on stderr: each push group whose listener could not be loaded."""
    for group, why in result.setup_errors:
        print(f"deltamq: error: group {group!r} consumed nothing: {why}", file=sys.stderr, flush=True)
    return SETUP_FAILED_EXIT if result.setup_errors else 0


def _tick_line(result) -> None:
    print(result.summary(), flush=True)
    _say_setup_errors(result)


def _loop(broker, args: argparse.Namespace) -> int:
    n = broker.runner.loop(
        args.interval,
        args.for_s,
        on_tick=_tick_line,
        on_wait=lambda e: print(f"waiting: {e}", flush=True),
        wake_at_due=args.wake,
    )
    print(f"stopped after {n} ticks")
    return 0


def job(broker, args: argparse.Namespace) -> int:
    from deltamq.errors import LeaseHeld
    from deltamq.orchestration.tick import TickRunner, job_sequence

    runner = TickRunner(broker.context, sequence=job_sequence(args.name))
    _ready()
    try:
        result = runner.tick(now_arg(args.now))
    except LeaseHeld as e:
        print(f"skipped: {e}", file=sys.stderr)
        return SKIPPED_EXIT
    finally:
        runner.release()
    print(result.summary(), flush=True)
    return _say_setup_errors(result)


def _ready() -> None:
    """Say the broker is open and the job about to run (for a harness that kills jobs at
    random times: tests/crash.py sets DELTAMQ_READY_LINE)."""
    if os.environ.get("DELTAMQ_READY_LINE"):
        print("READY", flush=True)
