"""The command line's arguments: the argparse tree (every command takes the ``common``
options ``--warehouse``, ``--remote`` and ``--json``), the parsing of time arguments, and
the exit statuses every command shares (``EXIT_STATUSES``, shown by ``deltamq --help``)
with the errors the command line raises itself."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from deltamq.constants import SETUP_FAILED_EXIT

# --- exit statuses: one scheme for every command ------------------------------------------------
OK = 0
CHECK_FAILED = 1
"""It ran, and its answer is no: a check found problems (``dq --fail-on-error``,
``doctor``) or ``msg show`` found no message."""
USAGE = 2
"""A usage error (argparse's own status), or deltamq refused (a ``DeltaMQError``: a bad value,
an unknown topic or group, no warehouse at the location, a clock going back...)."""
SKIPPED = 3
"""A one-shot ``tick`` or ``job`` did nothing: another runner holds its job lease."""
SETUP_FAILED = SETUP_FAILED_EXIT
"""A tick ran, but a push group or a sink consumed nothing: its listener or transform could not be loaded."""
NO_INPUT = 5
"""A file named on the command line cannot be opened (missing, unreadable, no such folder)."""
BAD_INPUT = 6
"""An input file is malformed (a ``send --file`` line: named file:line; nothing was sent)."""
ENGINE_REJECTED = 7
"""The engine rejected a statement (a ``sql`` query that does not parse or resolve) or
failed (a Spark or Spark Connect error)."""
INTERNAL = 70
"""A bug in deltamq (``DELTAMQ_DEBUG=1`` shows the traceback)."""
INTERRUPTED = 130
"""Ctrl-C stopped a one-shot command (``tick --loop`` stops cleanly, with 0)."""
CUT_OFF = 141
"""Whoever read stdout closed it early (``| head``): the rest of the output was dropped."""

EXIT_STATUSES: tuple[tuple[int, str], ...] = (
    (OK, "ok"),
    (CHECK_FAILED, "a check found problems (dq --fail-on-error, doctor); msg show found no message"),
    (USAGE, "usage error, or deltamq refused (a DeltaMQError: a bad value, an unknown topic, no warehouse)"),
    (SKIPPED, "tick/job skipped: another runner holds the job lease"),
    (SETUP_FAILED, "a push group's listener or a sink's transform could not be loaded (its messages wait)"),
    (NO_INPUT, "a file named on the command line cannot be opened (missing, unreadable)"),
    (BAD_INPUT, "an input file is malformed (send --file: file:line says what; nothing sent)"),
    (ENGINE_REJECTED, "the engine rejected a query or failed (a Spark / Spark Connect error)"),
    (INTERNAL, "a bug in deltamq (DELTAMQ_DEBUG=1 shows the traceback)"),
    (INTERRUPTED, "interrupted (Ctrl-C)"),
    (CUT_OFF, "stdout was closed early (| head): the rest of the output was dropped"),
)
"""(status, meaning): the table ``deltamq --help`` and the README show."""


class CliError(Exception):
    """An error the command line reports itself: one stderr line, and its exit status."""

    status = USAGE

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class UsageError(CliError):
    """The arguments do not make a command (exit 2, as argparse's own usage errors)."""

    status = USAGE


def refuse_unused(args: argparse.Namespace, command: str, unused: dict[str, tuple[str, Any]]) -> None:
    """UsageError naming the first option that ``command`` does not use yet was given:
    ``unused`` maps each such option's ``args`` name to (its flag, its default). An option
    accepted and then ignored would leave the user believing it took effect."""
    for dest, (flag, default) in unused.items():
        if getattr(args, dest, default) != default:
            raise UsageError(f"{command} takes no {flag}; see deltamq {command.split()[0]} --help")


class InputMissing(CliError):
    """A file named on the command line cannot be opened (exit 5)."""

    status = NO_INPUT


class InputMalformed(CliError):
    """An input file's content is malformed (exit 6)."""

    status = BAD_INPUT


EXAMPLES = """examples:
  deltamq demo
  deltamq init --warehouse ./wh
  deltamq topic create orders --queues 4 --warehouse ./wh
  deltamq topic list --warehouse ./wh
  deltamq group create billing --warehouse ./wh
  deltamq group list --warehouse ./wh
  deltamq subscribe billing orders 'created || paid' --warehouse ./wh
  deltamq send orders '{"id": 1}' --tags created --warehouse ./wh
  deltamq send orders 'check payment' --delay-ms 1800000 --warehouse ./wh
  deltamq tick --loop --interval 1 --warehouse ./wh
  deltamq status --json --warehouse ./wh
  deltamq sql "SELECT topic, count(*) FROM commit_log GROUP BY topic" --warehouse ./wh
  deltamq dlq list --group billing --warehouse ./wh
"""

OUTPUT = """output:
  tables on stdout by default; --json (every command but demo): one JSON document on
  stdout instead (tick --loop --json: one per tick, JSON Lines). Errors: one line on
  stderr, "deltamq: error: ..." (with --json also {"error": ..., "exit_status": N} on stdout).
"""

EPILOG = (
    EXAMPLES
    + "\n"
    + OUTPUT
    + "\nexit status:\n"
    + "".join(f"  {code:<4}{meaning}\n" for code, meaning in EXIT_STATUSES)
)

JOBS = ["dispatch", "promote", "deliver", "sink", "check_transactions", "retain"]
"""What ``deltamq job`` runs, one at a time."""

TIME = "epoch ms or ISO time, UTC unless it has an offset (2026-01-01T09:30:00)"
"""How every time argument is given."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors read as every other error: one line on stderr,
    ``deltamq: error: …`` naming the command's --help, and with ``--json`` also the error
    document on stdout (exit status 2, :data:`USAGE`)."""

    json_errors = False  # set by build_parser from the command line

    def error(self, message: str):  # noqa: ANN201 - NoReturn as argparse declares it
        import json
        import sys

        command = self.prog.removeprefix("deltamq").strip()
        text = f"{command + ': ' if command else ''}{message} (see {self.prog} --help)"
        print(f"deltamq: error: {text}", file=sys.stderr, flush=True)
        if _Parser.json_errors:
            print(json.dumps({"error": text, "exit_status": USAGE}), flush=True)
        raise SystemExit(USAGE)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``argv`` (the arguments it will parse) says whether a
    usage error also prints the JSON error document (``--json``)."""
    # argparse takes a long option's unambiguous prefix: --js, --jso as well as --json
    _Parser.json_errors = any(
        len(a) > 3 and "--json".startswith(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    common = _common()
    p = _Parser(
        prog="deltamq",
        description="RocketMQ semantics on Delta Lake.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # in the order --help lists them
    _admin_commands(sub, common)
    _send_command(sub, common)
    _run_and_query_commands(sub, common)
    _operator_commands(sub, common)
    s = sub.add_parser(
        "spark", help="Apache Spark with Delta: conf (the --packages/--conf lines) | fetch (resolve the jars)"
    )
    s.add_argument(
        "action", choices=["conf", "fetch"], help="conf: print the lines; fetch: resolve the jars once"
    )
    s.add_argument("--json", action="store_true", help="conf: one JSON document")
    s = sub.add_parser("demo", help="a guided tour on a fresh warehouse (about 10 seconds)")
    s.add_argument("--warehouse", "-w", help="directory for the demo warehouse (default: a temp dir)")
    return p


def _common() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--warehouse",
        "-w",
        default=os.environ.get("DELTAMQ_WAREHOUSE"),
        help="warehouse directory or URI (env DELTAMQ_WAREHOUSE)",
    )
    common.add_argument(
        "--remote",
        default=None,
        help="Spark Connect URL sc://host:port (env DELTAMQ_SPARK_REMOTE); default: embedded Sail",
    )
    common.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document on stdout instead of tables (for scripts)",
    )
    return common


_LEVELS_HELP = (
    "delay levels, e.g. '1s 5s 10s' (default: RocketMQ's 18, '1s 5s 10s 30s 1m ... 2h'); on a "
    "warehouse, at least as many as it has (delays may change, levels may be added)"
)


def _admin_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("init", parents=[common], help="create or upgrade a warehouse (idempotent)")
    s.add_argument("--levels", help=_LEVELS_HELP)

    s = sub.add_parser("topic", parents=[common], help="topic create | update | delete | list")
    s.add_argument("action", choices=["create", "update", "delete", "list"], help="what to do")
    s.add_argument("name", nargs="?", help="the topic (all but list)")
    s.add_argument("--queues", type=int, help="number of queues (create: default 4, DELTAMQ_DEFAULT_QUEUES)")
    s.add_argument(
        "--perm", choices=["RW", "R", "W", "DENY"], help="who may use it: R consumers, W producers"
    )
    s.add_argument(
        "--ordered",
        action="store_true",
        default=None,
        help="an ordered topic (orderly groups read it in order)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="delete: even with groups subscribed (their subscriptions go); update: fewer queues even "
        "with messages not consumed in those dropped",
    )

    s = sub.add_parser("group", parents=[common], help="consumer group create | update | delete | list")
    s.add_argument("action", choices=["create", "update", "delete", "list"], help="what to do")
    s.add_argument("name", nargs="?", help="the consumer group (all but list)")
    s.add_argument(
        "--force",
        action="store_true",
        help="delete: even with messages not consumed, retries waiting or pulls not acked",
    )
    s.add_argument(
        "--listener",
        help="a push group's listener, import path package.module:function (none: a pull group; "
        "update: the push group's new listener)",
    )
    s.add_argument(
        "--mode",
        choices=["CLUSTERING", "BROADCASTING"],
        default="CLUSTERING",
        help="CLUSTERING: each message to one member of the group (default); BROADCASTING: to every instance",
    )
    s.add_argument(
        "--orderly",
        action="store_true",
        help="consume each queue strictly in order (a failure suspends the queue, then its head is retried)",
    )
    s.add_argument(
        "--max-reconsume-times",
        type=int,
        help="retries before a message goes to %%DLQ%%<group> (default 16; orderly: unlimited)",
    )
    s.add_argument(
        "--consume-from",
        choices=["LAST_OFFSET", "FIRST_OFFSET", "TIMESTAMP"],
        default="LAST_OFFSET",
        help="where a new subscription starts (default LAST_OFFSET: only messages from now on)",
    )
    s.add_argument("--consume-timestamp", metavar="TIME", help=f"with --consume-from TIMESTAMP: {TIME}")
    s.add_argument(
        "--instances",
        metavar="NAME,NAME",
        help="BROADCASTING push group: the instances that each get every message (comma-separated; "
        "update: the new list, an added instance starting where --consume-from said)",
    )

    s = sub.add_parser(
        "catalog",
        parents=[common],
        help="name the tables and views DATABASE.<name> in an Apache Spark Connect server's catalog "
        "(needs --remote)",
    )
    s.add_argument("action", choices=["register"], help="register them")
    s.add_argument("--database", default="deltamq", help="the database to register them in (default deltamq)")

    _subscription_commands(sub, common)


def _subscription_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("subscribe", parents=[common], help="subscribe a group to a topic")
    s.add_argument("group", help="the consumer group")
    s.add_argument("topic", help="the topic")
    s.add_argument(
        "expression", nargs="?", default="*", help="tags: '*' or 'TagA || TagB'; or an SQL92 predicate"
    )
    s.add_argument("--type", default="TAG", choices=["TAG", "SQL92"], help="what the expression is")

    s = sub.add_parser(
        "unsubscribe", parents=[common], help="stop a group consuming a topic (its offsets stay)"
    )
    s.add_argument("group", help="the consumer group")
    s.add_argument("topic", help="the topic")


def _send_command(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("send", parents=[common], help="send messages (arguments or a JSON-lines file)")
    s.add_argument("topic", nargs="?", help="the topic (with --file: for lines that name none)")
    s.add_argument("body", nargs="?", help="the message body, as text (not with --file)")
    s.add_argument("--tags", help="the message's tag (what subscriptions filter on)")
    s.add_argument("--keys", help="business keys, space-separated (msg show --key finds them)")
    held = s.add_mutually_exclusive_group()
    held.add_argument(
        "--delay-level",
        type=int,
        default=0,
        metavar="N",
        help="deliver after delay level N (1..18 by default: 1s 5s 10s 30s 1m ... 2h); "
        "above the highest it is clamped, as RocketMQ does",
    )
    held.add_argument("--delay-ms", type=int, metavar="MS", help="deliver MS milliseconds from now (a timer)")
    held.add_argument("--deliver-at", metavar="TIME", help=f"deliver at TIME (a timer): {TIME}")
    s.add_argument(
        "--property", "-p", action="append", default=[], metavar="K=V", help="a user property (repeatable)"
    )
    s.add_argument(
        "--queue-key", metavar="KEY", help="choose the queue by KEY: equal keys share a queue (and its order)"
    )
    s.add_argument("--producer-group", default="DEFAULT_PRODUCER", help="the producer group to send as")
    s.add_argument(
        "--file",
        "-f",
        help="JSON lines: {topic, body, tags?, keys?, delay_level? | delay_ms? | deliver_at?, properties?}",
    )
    s.add_argument("--batch-size", type=int, default=10_000, help="messages per commit with --file")


def _run_and_query_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("sql", parents=[common], help="run SQL over the warehouse tables")
    s.add_argument("query", help="one statement; tables by name: commit_log, consume_queue, offsets, ...")
    s.add_argument(
        "--write",
        action="store_true",
        help="allow statements that change tables, named delta.`<path>` (the plain names are views)",
    )
    s.add_argument("--limit", type=_AT_LEAST_1, default=100, help="rows to show (default 100)")

    sub.add_parser(
        "status",
        parents=[common],
        help="topics, queues, every group's lag, pull clients, transactions, delays, recent ticks",
    )

    s = sub.add_parser("tick", parents=[common], help="run the broker's jobs once, or in a loop")
    s.add_argument("--now", help=f"the tick's now: {TIME} (default: wall clock)")
    s.add_argument(
        "--loop", action="store_true", help="tick until stopped (SIGTERM, Ctrl-C) or --for: the broker"
    )
    s.add_argument("--interval", type=_ABOVE_0, help="seconds between ticks with --loop (above 0; default 1)")
    s.add_argument("--for", dest="for_s", type=_ABOVE_0, help="stop the loop after this many seconds")
    s.add_argument(
        "--no-wake",
        dest="wake",
        action="store_false",
        help="with --loop: tick only every --interval (by default the loop also wakes when a delay, "
        "timer, retry or suspended queue falls due)",
    )

    s = sub.add_parser("offsets", parents=[common], help="reset a group's offsets to a time")
    s.add_argument("action", choices=["reset"], help="what to do")
    s.add_argument("--group", required=True, help="the consumer group")
    s.add_argument("--to-time", required=True, help=f"{TIME}: the first message stored at or after it")

    s = sub.add_parser("job", parents=[common], help="run one job (with its lease), e.g. for spark-submit")
    s.add_argument("name", choices=JOBS, help="the job")
    s.add_argument("--now", help=f"{TIME} (default: wall clock)")


def _operator_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("dlq", parents=[common], help="dead letters: dlq list | resend")
    s.add_argument("action", choices=["list", "resend"], help="list them, or resend them to their topic")
    _selection_args(s)
    s.add_argument("--limit", type=_AT_LEAST_1, help="list: rows to list (default 100); not for resend")
    s.add_argument("--rate", type=_ABOVE_0, help="resend at most this many messages per second")

    s = sub.add_parser("msg", parents=[common], help="a message's trace: sent, delayed, retried, consumed")
    s.add_argument("action", choices=["show"], help="show the trace")
    s.add_argument("id", nargs="?", help="message id (the producer's, or any copy's)")
    s.add_argument("--key", help="find the messages sent with this business key instead")
    s.add_argument("--from", dest="from_time", help=f"with --key: stored at or after ({TIME})")
    s.add_argument("--to", dest="to_time", help=f"with --key: stored before ({TIME})")

    s = sub.add_parser("dq", parents=[common], help="run the data-quality suites and the conservation check")
    s.add_argument(
        "--table", action="append", help="only this table's suite (repeatable; 'conservation' too)"
    )
    s.add_argument("--fail-on-error", action="store_true", help="exit 1 if any expectation failed")

    sub.add_parser(
        "rebuild-index", parents=[common], help="rebuild consume_queue from commit_log (holds every lease)"
    )

    sub.add_parser(
        "doctor",
        parents=[common],
        help="list data files the Delta log references that are missing or truncated (exit 1 if any)",
    )

    s = sub.add_parser("report", parents=[common], help="an HTML page of lag and throughput over time")
    s.add_argument("--html", required=True, metavar="FILE", help="the page to write")
    s.add_argument("--from", dest="from_time", help=f"ticks at or after ({TIME})")
    s.add_argument("--to", dest="to_time", help=f"ticks before ({TIME})")


def _selection_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--group", help="only the dead letters of this consumer group")
    s.add_argument("--from", dest="from_time", help=f"stored at or after ({TIME})")
    s.add_argument("--to", dest="to_time", help=f"stored before ({TIME})")
    s.add_argument("--id", action="append", help="a dead letter's or original message's id (repeatable)")
    s.add_argument("--where", help="SQL predicate over the consume_queue row, e.g. \"keys = 'o-1'\"")


def _bounded(convert, ok, rule: str):
    """An argparse type: ``convert(text)`` (int or float) for which ``ok`` holds, else
    an error saying ``rule`` (argparse names the option)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {'whole number' if convert is int else 'number'}"
            ) from None
        if not ok(value):  # NaN fails every bound
            raise argparse.ArgumentTypeError(f"{text} is {rule}")
        return value

    return parse


_AT_LEAST_1 = _bounded(int, lambda v: v >= 1, "below 1, the least allowed")
_ABOVE_0 = _bounded(float, lambda v: 0 < v < float("inf"), "not a number above 0")


def now_arg(text: str | None, option: str = "--now") -> int | None:
    """A time argument (epoch ms or ISO time; naive ISO is UTC) as epoch ms; None if not
    given. ``option`` names the argument in the error."""
    from datetime import datetime

    from deltamq.clock import check_ms, to_ms

    if not text:
        return None
    try:
        ms = int(text) if text.isdigit() else to_ms(datetime.fromisoformat(text))
    except ValueError:
        raise UsageError(
            f"{option} {text!r} is neither epoch ms nor an ISO time (e.g. 2026-01-01T09:30:00)"
        ) from None
    try:
        return check_ms(ms, option)
    except ValueError as e:
        raise UsageError(str(e)) from None
