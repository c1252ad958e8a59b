"""The ``deltamq`` command line.

Every command takes ``--warehouse`` (or ``DELTAMQ_WAREHOUSE``) and optionally
``--remote sc://host:port`` (or ``DELTAMQ_SPARK_REMOTE``); without one it uses the
embedded Sail engine.

``main`` parses the arguments (``parser``), opens the warehouse's broker and hands it to
the command's handler: one function ``(broker, args) -> int`` per command, in a module
per command group (``admin``, ``produce``, ``query``, ``status``, ``run``); ``init`` and
``demo`` run without a broker. Output goes through ``format``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from deltamq.cli import admin, demo, produce, query, run, status
from deltamq.cli.format import print_table
from deltamq.cli.parser import build_parser
from deltamq.cli.run import SKIPPED_EXIT
from deltamq.errors import DeltaMQError

__all__ = ["COMMANDS", "SKIPPED_EXIT", "WITHOUT_BROKER", "main", "print_table"]

Handler = Callable[[Any, argparse.Namespace], int]

WITHOUT_BROKER: dict[str, Callable[[argparse.Namespace], int]] = {
    "init": admin.init,  # the one command that creates a warehouse
    "demo": demo.demo,  # makes its own
}
"""Commands that open no broker, by name."""

COMMANDS: dict[str, Handler] = {
    "topic": admin.topic,
    "group": admin.group,
    "subscribe": admin.subscribe,
    "offsets": admin.offsets,
    "rebuild-index": admin.rebuild_index,
    "send": produce.send,
    "sql": query.sql,
    "msg": query.msg,
    "dlq": query.dlq,
    "dq": query.dq,
    "doctor": query.doctor,
    "report": query.report,
    "status": status.status,
    "tick": run.tick,
    "job": run.job,
}
"""The other commands' handlers, by name: each gets the warehouse's open broker."""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _listeners_from_here()
    try:
        return _run(args)
    except DeltaMQError as e:
        print(f"deltamq: error: {e}", file=sys.stderr)
        return 2


def _listeners_from_here() -> None:
    """Listener, check and transform modules named by import path are looked for in the
    current folder too, as ``python`` run there would — after the installed packages, so
    a folder there cannot shadow one (a console script's path does not hold the folder)."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)


def _run(args: argparse.Namespace) -> int:
    if args.command in WITHOUT_BROKER:
        return WITHOUT_BROKER[args.command](args)
    handler = COMMANDS[args.command]
    broker = _open(args)
    try:
        return handler(broker, args)
    finally:
        broker.close()  # a one-shot command (or a stopped loop) gives its leases back


def _open(args: argparse.Namespace):
    from deltamq.broker import Broker

    if not args.warehouse:
        raise SystemExit("deltamq: error: give --warehouse DIR (or set DELTAMQ_WAREHOUSE)")
    # only `init` creates a warehouse: a typo'd location must not become a new one
    return Broker.open(args.warehouse, remote=args.remote, create=False)
