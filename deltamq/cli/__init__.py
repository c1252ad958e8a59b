"""The ``deltamq`` command line.

Every command takes ``--warehouse`` (or ``DELTAMQ_WAREHOUSE``) and optionally
``--remote sc://host:port`` (or ``DELTAMQ_SPARK_REMOTE``); without one it uses the
embedded Sail engine.

``main`` parses the arguments (``parser``), opens the warehouse's broker and hands it to
the command's handler: one function ``(broker, args) -> int`` per command, in a module
per command group (``admin``, ``produce``, ``query``, ``status``, ``run``); ``init`` and
``demo`` run without a broker. Output goes through ``format`` (tables, or ``--json``).

Every error ends here, as one ``deltamq: error: ...`` line on stderr and the exit status
of its kind (``parser.EXIT_STATUSES``): deltamq's own errors, the command line's
(``parser.CliError``), the engine's (PySpark and Spark Connect exceptions, caught here and
nowhere below), files that cannot be opened, and anything else as an internal error.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from deltamq.cli import admin, demo, produce, query, run, spark, status
from deltamq.cli.format import json_line, print_table
from deltamq.cli.parser import (
    CUT_OFF,
    ENGINE_REJECTED,
    INTERNAL,
    INTERRUPTED,
    NO_INPUT,
    USAGE,
    CliError,
    UsageError,
    build_parser,
)
from deltamq.cli.run import SETUP_FAILED_EXIT, SKIPPED_EXIT
from deltamq.errors import DeltaMQError

__all__ = ["COMMANDS", "SETUP_FAILED_EXIT", "SKIPPED_EXIT", "WITHOUT_BROKER", "main", "print_table"]

Handler = Callable[[Any, argparse.Namespace], int]

WITHOUT_BROKER: dict[str, Callable[[argparse.Namespace], int]] = {
    "init": admin.init,  # the one command that creates a warehouse
    "demo": demo.demo,  # makes its own
    "spark": spark.spark,  # prints or fetches what an Apache Spark deployment needs
}
"""Commands that open no broker, by name."""

COMMANDS: dict[str, Handler] = {
    "topic": admin.topic,
    "group": admin.group,
    "subscribe": admin.subscribe,
    "unsubscribe": admin.unsubscribe,
    "catalog": admin.catalog,
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


_BROKER_MODULES = (
    "pyspark", "pysail", "delta", "grpc", "grpc_status", "google.protobuf", "google.rpc", "pandas",
    "great_expectations", "plotly", "xxhash",
)  # fmt: skip
"""Modules of the ``broker`` extra's packages (PySpark and its Connect client's needs,
Sail, delta-spark, the checks, the report): a command that finds one missing was
installed without it."""


def _from_broker_extra(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _BROKER_MODULES)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (``parser.EXIT_STATUSES``). Usage errors
    exit through argparse (SystemExit 2)."""
    args = build_parser(argv).parse_args(argv)
    # delta-rs logs the AWS credential chain's fallbacks as WARN lines on stderr before the
    # one-line error that says the same; the CLI shows errors only (RUST_LOG still rules)
    os.environ.setdefault("RUST_LOG", "error")
    _listeners_from_here()
    try:
        return _run(args)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", INTERRUPTED)
    except BrokenPipeError:
        _drop_stdout()
        return CUT_OFF
    except CliError as e:
        return _fail(args, str(e), e.status)
    except DeltaMQError as e:
        return _fail(args, str(e), USAGE)
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and _from_broker_extra(e.name or ""):
            return _fail(  # installed as deltamq[producer]
                args,
                f"`deltamq {args.command}` needs the broker's engine "
                f"({(e.name or '').split('.')[0]} is not installed): "
                "pip install 'deltamq[broker]'. deltamq[producer] alone has the Spark-free "
                "Producer and PullConsumer (deltamq.lite), not the command line",
                USAGE,
            )
        if isinstance(e, OSError) and e.filename is not None:  # a file named on the command line
            return _fail(args, f"cannot open {e.filename}: {e.strerror or e}", NO_INPUT)
        if _is_engine_error(e):
            return _fail(args, _engine_error(args, e), ENGINE_REJECTED)
        if os.environ.get("DELTAMQ_DEBUG"):
            raise
        return _fail(
            args,
            f"internal error (a bug in deltamq): {type(e).__name__}: {_first_line(str(e))} "
            "(DELTAMQ_DEBUG=1 shows the traceback)",
            INTERNAL,
        )


def _drop_stdout() -> None:
    """The reader of stdout went away (``| head``): what is left to print (Python's own
    flush at exit included) goes nowhere, without a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind stdout (a test's capture)
        pass


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    """Say why on one stderr line (and with --json as the stdout document); ``status``."""
    print(f"deltamq: error: {message}", file=sys.stderr, flush=True)
    if getattr(args, "json", False):
        print(json_line({"error": message, "exit_status": status}), flush=True)
    return status


def _is_engine_error(e: Exception) -> bool:
    """A PySpark exception (Spark Connect's included) or a bare gRPC error: checked through
    the modules already loaded, so the check imports no engine."""
    errors = sys.modules.get("pyspark.errors")
    if errors is not None and isinstance(e, errors.PySparkException):
        return True
    grpc = sys.modules.get("grpc")
    return grpc is not None and isinstance(e, grpc.RpcError)


def _engine_error(args: argparse.Namespace, e: Exception) -> str:
    """One line: what the engine said (its message's first meaningful line), for ``sql``
    with the query and, for a ``DESCRIBE name`` Sail does not take, what it takes."""
    said = _first_line(_engine_message(e))
    if args.command != "sql":
        return f"the engine failed: {said}"
    query = " ".join(args.query.split())
    shown = query if len(query) <= 80 else query[:77] + "..."
    hint = ""
    words = query.split()
    if len(words) == 2 and words[0].upper() in ("DESCRIBE", "DESC"):
        hint = f" (to describe a table: DESCRIBE TABLE {words[1]})"
    said, more = _plainer(said)
    if getattr(args, "write", False) and not hint:
        # the names are views of the tables (re-registered per query): a change names the
        # table itself, delta.`<its path>`, as Broker.sql says
        hint = (
            " (with --write, name a table to change as delta.`<path>`, e.g. "
            "delta.`<warehouse>/offsets`; the plain names are read-only views)"
        )
    return f"the engine rejected the query {shown!r}: {said}{hint or more}"


# Sail's own wording of an unknown column: attribute ObjectName([Identifier("a"), ...]) is missing ...
_SAIL_MISSING_COLUMN = re.compile(r"attribute ObjectName\(\[(.*?)\]\) is missing from the schema")


def _plainer(said: str) -> tuple[str, str]:
    """An engine's text for an unknown column or table in the user's words, with where to
    look: ``(text, hint)``. Apache Spark's own texts are already plain and name
    alternatives; Sail's unknown column names an internal structure."""
    missing = _SAIL_MISSING_COLUMN.search(said)
    if missing:
        column = ".".join(re.findall(r'Identifier\("((?:[^"\\]|\\.)*)"\)', missing.group(1)))
        return (
            f"no column {column!r} in what the query reads",
            " (DESCRIBE TABLE <name> lists a table's columns)",
        )
    if "TABLE_OR_VIEW_NOT_FOUND" in said:
        from deltamq.schemas import TABLES
        from deltamq.tables.views import VIEWS

        return said, f" (deltamq's tables: {', '.join(TABLES)}; views: {', '.join(VIEWS)})"
    return said, ""


def _engine_message(e: Exception) -> str:
    get = getattr(e, "getMessage", None)
    if callable(get):
        try:
            text = get()
        except Exception:  # noqa: BLE001 - fall back to str()
            text = None
        if text:
            return str(text)
    details = getattr(e, "details", None)  # a grpc.RpcError
    if callable(details):
        try:
            return str(details() or e)
        except Exception:  # noqa: BLE001 - fall back to str()
            pass
    return str(e)


def _first_line(text: str) -> str:
    """The first line that says something (not blank, not a stack-trace heading)."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.lower().startswith(("jvm stacktrace", "traceback")):
            return line if len(line) <= 400 else line[:397] + "..."
    return text.strip() or "(no message)"


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
        raise UsageError("give --warehouse DIR (or set DELTAMQ_WAREHOUSE)")
    # only `init` creates a warehouse: a typo'd location must not become a new one
    return Broker.open(args.warehouse, remote=args.remote)
