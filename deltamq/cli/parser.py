"""The command line's arguments: the argparse tree (every command takes the ``common``
options ``--warehouse`` and ``--remote``) and the parsing of time arguments."""

from __future__ import annotations

import argparse
import os

EPILOG = """examples:
  deltamq demo
  deltamq init --warehouse ./wh
  deltamq topic create orders --queues 4 --warehouse ./wh
  deltamq group create billing --warehouse ./wh
  deltamq subscribe billing orders 'created || paid' --warehouse ./wh
  deltamq send orders '{"id": 1}' --tags created --warehouse ./wh
  deltamq tick --loop --interval 1 --warehouse ./wh
  deltamq sql "SELECT topic, count(*) FROM commit_log GROUP BY topic" --warehouse ./wh
"""

JOBS = ["dispatch", "promote", "deliver", "sink", "check_transactions", "retain"]
"""What ``deltamq job`` runs, one at a time."""


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    p = argparse.ArgumentParser(
        prog="deltamq",
        description="RocketMQ semantics on Delta Lake.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    # in the order --help lists them
    _admin_commands(sub, common)
    _send_command(sub, common)
    _run_and_query_commands(sub, common)
    _operator_commands(sub, common)
    s = sub.add_parser("demo", help="a guided tour on a fresh warehouse (about 10 seconds)")
    s.add_argument("--warehouse", "-w", help="directory for the demo warehouse (default: a temp dir)")
    return p


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
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
    return common


def _admin_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("init", parents=[common], help="create or upgrade a warehouse (idempotent)")
    s.add_argument("--levels", help="delay level string, default '1s 5s 10s 30s 1m ... 2h'")

    s = sub.add_parser("topic", parents=[common], help="create, update or delete a topic")
    s.add_argument("action", choices=["create", "update", "delete", "list"])
    s.add_argument("name", nargs="?")
    s.add_argument("--queues", type=int)
    s.add_argument("--perm", choices=["RW", "R", "W", "DENY"])
    s.add_argument("--ordered", action="store_true", default=None)

    s = sub.add_parser("group", parents=[common], help="create or delete a consumer group")
    s.add_argument("action", choices=["create", "delete", "list"])
    s.add_argument("name", nargs="?")
    s.add_argument("--listener", help="import path package.module:function")
    s.add_argument("--mode", choices=["CLUSTERING", "BROADCASTING"], default="CLUSTERING")
    s.add_argument("--orderly", action="store_true")
    s.add_argument("--max-reconsume-times", type=int)
    s.add_argument(
        "--consume-from", choices=["LAST_OFFSET", "FIRST_OFFSET", "TIMESTAMP"], default="LAST_OFFSET"
    )
    s.add_argument("--consume-timestamp", type=int, help="epoch ms, with --consume-from TIMESTAMP")

    s = sub.add_parser("subscribe", parents=[common], help="subscribe a group to a topic")
    s.add_argument("group")
    s.add_argument("topic")
    s.add_argument("expression", nargs="?", default="*", help="'*' or 'TagA || TagB'")
    s.add_argument("--type", default="TAG", choices=["TAG", "SQL92"])


def _send_command(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("send", parents=[common], help="send messages (arguments or a JSON-lines file)")
    s.add_argument("topic", nargs="?")
    s.add_argument("body", nargs="?")
    s.add_argument("--tags")
    s.add_argument("--keys")
    s.add_argument("--delay-level", type=int, default=0)
    s.add_argument("--property", "-p", action="append", default=[], metavar="K=V")
    s.add_argument("--queue-key")
    s.add_argument("--producer-group", default="DEFAULT_PRODUCER")
    s.add_argument("--file", "-f", help="JSON lines: {topic, body, tags?, keys?, delay_level?, properties?}")
    s.add_argument("--batch-size", type=int, default=10_000, help="messages per commit with --file")


def _run_and_query_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("sql", parents=[common], help="run SQL over the warehouse tables")
    s.add_argument("query")
    s.add_argument("--write", action="store_true", help="allow statements that change tables")
    s.add_argument("--limit", type=int, default=100)

    sub.add_parser("status", parents=[common], help="topics, queues and counts so far")

    s = sub.add_parser("tick", parents=[common], help="run the broker's jobs once, or in a loop")
    s.add_argument("--now", help="the tick's now: epoch ms or ISO time (default: wall clock)")
    s.add_argument("--loop", action="store_true")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between ticks with --loop")
    s.add_argument("--for", dest="for_s", type=float, help="stop the loop after this many seconds")
    s.add_argument(
        "--no-wake",
        dest="wake",
        action="store_false",
        help="with --loop: tick only every --interval (by default the loop also wakes when a delay, "
        "timer, retry or suspended queue falls due)",
    )

    s = sub.add_parser("offsets", parents=[common], help="reset a group's offsets to a time")
    s.add_argument("action", choices=["reset"])
    s.add_argument("--group", required=True)
    s.add_argument(
        "--to-time", required=True, help="epoch ms or ISO time: first message stored at or after it"
    )

    s = sub.add_parser("job", parents=[common], help="run one job (with its lease), e.g. for spark-submit")
    s.add_argument("name", choices=JOBS)
    s.add_argument("--now", help="epoch ms or ISO time (default: wall clock)")


def _operator_commands(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("dlq", parents=[common], help="list dead letters, or resend them to their topic")
    s.add_argument("action", choices=["list", "resend"])
    _selection_args(s)
    s.add_argument("--limit", type=int, default=100, help="rows to list")
    s.add_argument("--rate", type=float, help="resend at most this many messages per second")

    s = sub.add_parser("msg", parents=[common], help="a message's trace: sent, delayed, retried, consumed")
    s.add_argument("action", choices=["show"])
    s.add_argument("id", nargs="?", help="message id (the producer's, or any copy's)")
    s.add_argument("--key", help="find the messages sent with this business key instead")
    s.add_argument("--from", dest="from_time", help="with --key: stored at or after (epoch ms or ISO)")
    s.add_argument("--to", dest="to_time", help="with --key: stored before (epoch ms or ISO)")

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
        help="list data files the Delta log references that are missing or truncated",
    )

    s = sub.add_parser("report", parents=[common], help="an HTML page of lag and throughput over time")
    s.add_argument("--html", required=True, metavar="FILE")
    s.add_argument("--from", dest="from_time", help="ticks at or after (epoch ms or ISO)")
    s.add_argument("--to", dest="to_time", help="ticks before (epoch ms or ISO)")


def _selection_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--group", help="the consumer group whose dead letters")
    s.add_argument("--from", dest="from_time", help="stored at or after (epoch ms or ISO)")
    s.add_argument("--to", dest="to_time", help="stored before (epoch ms or ISO)")
    s.add_argument("--id", action="append", help="a dead letter's or original message's id (repeatable)")
    s.add_argument("--where", help="SQL predicate over the consume_queue row, e.g. \"keys = 'o-1'\"")


def now_arg(text: str | None) -> int | None:
    """A time argument (epoch ms or ISO time) as epoch ms; None if not given."""
    from deltamq.clock import to_ms

    if not text:
        return None
    return int(text) if text.isdigit() else to_ms(_parse_iso(text))


def _parse_iso(text: str):
    from datetime import datetime

    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise SystemExit(f"deltamq: error: --now {text!r} is neither epoch ms nor an ISO time") from None
