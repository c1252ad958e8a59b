"""The ``deltamq`` command line.

Every command takes ``--warehouse`` (or ``DELTAMQ_WAREHOUSE``) and optionally
``--remote sc://host:port`` (or ``DELTAMQ_SPARK_REMOTE``); without one it uses the
embedded Sail engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from deltamq.errors import DeltaMQError

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


def _parser() -> argparse.ArgumentParser:
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

    p = argparse.ArgumentParser(
        prog="deltamq",
        description="RocketMQ semantics on Delta Lake.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

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

    s = sub.add_parser("offsets", parents=[common], help="reset a group's offsets to a time")
    s.add_argument("action", choices=["reset"])
    s.add_argument("--group", required=True)
    s.add_argument(
        "--to-time", required=True, help="epoch ms or ISO time: first message stored at or after it"
    )

    s = sub.add_parser("job", parents=[common], help="run one job (with its lease), e.g. for spark-submit")
    s.add_argument("name", choices=["dispatch", "promote", "deliver", "sink", "check_transactions", "retain"])
    s.add_argument("--now", help="epoch ms or ISO time (default: wall clock)")

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

    s = sub.add_parser("demo", help="a guided tour on a fresh warehouse (about half a minute)")
    s.add_argument("--warehouse", "-w", help="directory for the demo warehouse (default: a temp dir)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except DeltaMQError as e:
        print(f"deltamq: error: {e}", file=sys.stderr)
        return 2


def _open(args: argparse.Namespace):
    from deltamq.broker import Broker

    if not args.warehouse:
        raise SystemExit("deltamq: error: give --warehouse DIR (or set DELTAMQ_WAREHOUSE)")
    # only `init` creates a warehouse: a typo'd location must not become a new one
    return Broker.open(args.warehouse, remote=args.remote, create=False)


def _run(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "demo":
        from deltamq.demo import run_demo

        run_demo(args.warehouse)
        return 0
    if cmd == "init":
        from deltamq.config import BrokerConfig
        from deltamq.engine import Engine
        from deltamq.tables.warehouse import Warehouse

        if not args.warehouse:
            raise SystemExit("deltamq: error: give --warehouse DIR (or set DELTAMQ_WAREHOUSE)")
        engine = Engine.open(BrokerConfig.from_env(**({"remote": args.remote} if args.remote else {})))
        done = Warehouse(engine, args.warehouse).init(args.levels)
        print(json.dumps(done))
        return 0
    broker = _open(args)
    try:
        return _dispatch_command(broker, args)
    finally:
        broker.close()  # a one-shot command (or a stopped loop) gives its leases back


def _dispatch_command(broker, args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "topic":
        return _topic(broker, args)
    if cmd == "group":
        return _group(broker, args)
    if cmd == "subscribe":
        broker.subscribe(args.group, args.topic, args.expression, args.type)
        print(f"subscribed {args.group} to {args.topic} ({args.type} {args.expression})")
        return 0
    if cmd == "send":
        return _send(broker, args)
    if cmd == "sql":
        df = broker.sql(args.query, write=args.write)
        rows = df.limit(args.limit).collect() if df.columns else df.collect()
        print_table(df.columns, [list(r) for r in rows])
        return 0
    if cmd == "status":
        from deltamq.clock import ms_to_iso

        st = broker.status()
        print_table(
            ["topic", "queues", "perm", "ordered"],
            [[t, v["queues"], v["perm"], v["ordered"]] for t, v in st["topics"].items()],
        )
        print()
        print_table(
            ["topic", "queue", "min offset", "max offset", "messages"],
            [
                [q["topic"], q["queue_id"], q["min_offset"], q["max_offset"], n]
                for q in st["queues"]
                for n in [q["max_offset"] - q["min_offset"]]
            ],
        )
        print(
            f"\nstored, not yet dispatched: {st['undispatched']} (dispatched up to commit_log "
            f"version {st['dispatched_version']})"
        )
        print("\nconsumer groups (lag = messages indexed but not yet consumed):")
        print_table(
            ["group", "instance", "topic", "queue", "next offset", "lag", "suspended until"],
            [
                [
                    g["group"],
                    g["client"] or "-",
                    g["topic"],
                    g["queue_id"],
                    g["next_offset"],
                    g["lag"],
                    ms_to_iso(g["suspend_until"]),
                ]
                for g in st["lag"]
            ],
        )
        print(
            "\ndead letters (indexed): "
            + (", ".join(f"{t}: {n}" for t, n in sorted(st["dead_letters"].items())) or "none")
        )
        print("\npull clients (rebalance: assigned queues; access lock: queues held):")
        print_table(
            ["group", "client", "last seen", "assigned", "locked", "in flight"],
            [
                [
                    c["group"],
                    c["client"],
                    ms_to_iso(c["last_seen"]),
                    " ".join(f"{t}:{q}" for t, q in c["assigned"]) or "-",
                    " ".join(f"{t}:{q}" for t, q in c["locked"]) or "-",
                    c["in_flight"],
                ]
                for c in st["pull_clients"]
            ],
        )
        print("\ntransactions (half messages not yet settled, per producer group):")
        print_table(
            ["producer group", "pending", "oldest age (s)", "most checks", "discarded"],
            [
                [
                    tx["producer_group"],
                    tx["pending"],
                    "-" if tx["oldest_age_ms"] is None else round(tx["oldest_age_ms"] / 1000, 1),
                    "-" if tx["max_checks"] is None else tx["max_checks"],
                    tx["discarded"],
                ]
                for tx in st["transactions"]
            ],
        )
        print("\ndelay levels (SCHEDULE_TOPIC_XXXX):")
        print_table(
            ["level", "delay", "offset", "pending", "oldest due"],
            [
                [
                    lv["level"],
                    f"{lv['delay_ms'] / 1000:g}s",
                    lv["offset"],
                    lv["pending"],
                    ms_to_iso(lv["oldest_due"]),
                ]
                for lv in st["levels"]
            ],
        )
        print("\ntimers pending by due day (rmq_sys_wheel_timer):")
        print_table(
            ["due day", "pending", "first due"],
            [[t["due_day"], t["pending"], ms_to_iso(t["first_due"])] for t in st["timers"]],
        )
        print("\nrecent job runs (job_runs):")
        print_table(
            ["tick now", "job", "status", "in", "out", "ms", "error"],
            [
                [
                    ms_to_iso(r["now_ts"]),
                    r["job"],
                    r["status"],
                    r["rows_in"],
                    r["rows_out"],
                    r["ms"],
                    r["error"],
                ]
                for r in st["recent_runs"]
            ],
        )
        return 0
    if cmd == "dlq":
        return _dlq(broker, args)
    if cmd == "msg":
        return _msg(broker, args)
    if cmd == "dq":
        result = broker.check_quality(args.table or None)
        print_table(
            ["suite", "expectation", "unexpected", "sample ids"],
            [
                [
                    r.suite,
                    r.expectation,
                    r.unexpected_count,
                    " ".join(r.sample_ids[:5]) or (r.observed or "")[:80],
                ]
                for r in result.failures
            ],
        )
        print(
            f"{len(result.results)} expectations, {len(result.failures)} failed "
            f"(run {result.run_id}, recorded in dq_results)"
        )
        return 1 if args.fail_on_error and not result.success else 0
    if cmd == "doctor":
        from deltamq.tables.integrity import damaged_files

        damage = damaged_files(broker.warehouse)
        for d in damage:
            print(d.describe())
        print(f"{len(damage)} damaged data file(s)" if damage else "every referenced data file is whole")
        return 1 if damage else 0
    if cmd == "rebuild-index":
        from deltamq.ops import rebuild_index

        print(json.dumps(rebuild_index(broker, broker.clock.now_ms())))
        return 0
    if cmd == "report":
        from deltamq.report import write_html

        data = write_html(broker, args.html, since=_now_arg(args.from_time), until=_now_arg(args.to_time))
        print(f"wrote {args.html}: {len(data['ticks'])} ticks, totals {json.dumps(data['totals'])}")
        return 0
    if cmd == "tick":
        return _tick(broker, args)
    if cmd == "offsets":
        new = broker.reset_offsets(args.group, _now_arg(args.to_time))
        print_table(["topic", "queue", "next offset"], [[t, q, o] for (t, q), o in sorted(new.items())])
        return 0
    if cmd == "job":
        from deltamq.errors import LeaseHeld
        from deltamq.orchestration.tick import TickRunner, job_sequence

        runner = TickRunner(broker, sequence=job_sequence(args.name))
        _ready()
        try:
            result = runner.tick(_now_arg(args.now))
        except LeaseHeld as e:
            print(f"skipped: {e}", file=sys.stderr)
            return SKIPPED_EXIT
        finally:
            runner.release()
        print(result.summary(), flush=True)
        return 0
    raise SystemExit(f"unknown command {cmd}")  # pragma: no cover


def _selection(args) -> dict:
    return {
        "group": args.group,
        "since": _now_arg(args.from_time),
        "until": _now_arg(args.to_time),
        "msg_ids": args.id or None,
        "where": args.where,
    }


def _selection_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--group", help="the consumer group whose dead letters")
    s.add_argument("--from", dest="from_time", help="stored at or after (epoch ms or ISO)")
    s.add_argument("--to", dest="to_time", help="stored before (epoch ms or ISO)")
    s.add_argument("--id", action="append", help="a dead letter's or original message's id (repeatable)")
    s.add_argument("--where", help="SQL predicate over the consume_queue row, e.g. \"keys = 'o-1'\"")


def _dlq(broker, args) -> int:
    from deltamq.clock import ms_to_iso

    if args.action == "list":
        rows = broker.dead_letters(**_selection(args)).orderBy("store_ts").limit(args.limit).collect()
        print_table(
            [
                "group",
                "dead letter",
                "original id",
                "topic",
                "reason",
                "retries",
                "stored",
                "keys",
                "last error",
            ],
            [
                [
                    r["consumer_group"],
                    r["msg_id"],
                    r["origin_id"],
                    r["original_topic"],
                    r["reason"],
                    r["reconsume_times"],
                    ms_to_iso(r["store_ts"]),
                    r["keys"],
                    (r["last_error"] or "")[:60],
                ]
                for r in rows
            ],
        )
        return 0
    done = broker.resend_dead_letters(rate_per_s=args.rate, **_selection(args))
    print(
        f"selected {done.selected}, resent {done.resent}, already resent before {done.already_resent}"
        + (f"; new ids {' '.join(done.msg_ids)}" if done.msg_ids else "")
    )
    return 0


def _msg(broker, args) -> int:
    from deltamq.clock import ms_to_iso

    if not args.id and not args.key:
        raise SystemExit("deltamq: error: msg show needs a message id or --key K")
    targets = (
        [args.id]
        if args.id
        else broker.find_by_key(args.key, since=_now_arg(args.from_time), until=_now_arg(args.to_time))
    )
    if not targets:
        print("no message found")
        return 1
    for mid in targets:
        print(f"message {mid}:")
        print_table(
            ["stored", "event", "topic", "queue", "offset", "id", "due", "groups"],
            [
                [
                    ms_to_iso(e["store_ts"]),
                    e["event"] + (f" — {e['error'][:60]}" if e["error"] else ""),
                    e["topic"],
                    e["queue_id"],
                    e["queue_offset"],
                    e["msg_id"],
                    ms_to_iso(e["due_ts"]),
                    "; ".join(e["groups"]) or "-",
                ]
                for e in broker.trace(mid)
            ],
        )
    return 0


def _topic(broker, args) -> int:
    if args.action == "list":
        print_table(
            ["topic", "queues", "perm", "ordered"],
            [[t, v["queues"], v["perm"], v["ordered"]] for t, v in broker.topics().items()],
        )
        return 0
    if not args.name:
        raise SystemExit(f"deltamq: error: topic {args.action} needs a topic name")
    if args.action == "create":
        broker.create_topic(args.name, args.queues, args.perm or "RW", ordered=bool(args.ordered))
    elif args.action == "update":
        broker.update_topic(args.name, queues=args.queues, perm=args.perm, ordered=args.ordered)
    else:
        broker.delete_topic(args.name)
    print(f"topic {args.action}d: {args.name}")
    return 0


def _group(broker, args) -> int:
    if args.action == "list":
        rows = broker.groups()
        print_table(
            ["group", "mode", "orderly", "max reconsume", "consume from", "listener"],
            [
                [g, r["mode"], r["orderly"], r["max_reconsume_times"], r["consume_from"], r["listener"]]
                for g, r in rows.items()
            ],
        )
        return 0
    if not args.name:
        raise SystemExit(f"deltamq: error: group {args.action} needs a group name")
    if args.action == "create":
        broker.create_group(
            args.name,
            args.listener,
            mode=args.mode,
            orderly=args.orderly,
            max_reconsume_times=args.max_reconsume_times,
            consume_from=args.consume_from,
            consume_timestamp=args.consume_timestamp,
        )
    else:
        broker.delete_group(args.name)
    print(f"group {args.action}d: {args.name}")
    return 0


def _parse_props(items: list[str]) -> dict[str, str]:
    props = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"deltamq: error: --property {item!r} is not K=V")
        props[k] = v
    return props


def _send(broker, args) -> int:
    from deltamq.message import Message

    producer = broker.producer(args.producer_group)
    if args.file:
        total = 0
        batch: list[Message] = []
        with open(args.file, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    body = obj["body"] if isinstance(obj["body"], str) else json.dumps(obj["body"])
                    batch.append(
                        Message(
                            obj["topic"],
                            body,
                            tags=obj.get("tags"),
                            keys=obj.get("keys"),
                            delay_level=obj.get("delay_level", 0),
                            properties=obj.get("properties"),
                        )
                    )
                except (KeyError, ValueError, TypeError) as e:
                    raise SystemExit(f"deltamq: error: {args.file}:{lineno}: {e}") from e
                if len(batch) >= args.batch_size:
                    total += len(producer.send_batch(batch))
                    batch = []
                    print(f"sent {total} messages...", file=sys.stderr)
        if batch:
            total += len(producer.send_batch(batch))
        print(f"sent {total} messages from {args.file}")
        return 0
    if not args.topic or args.body is None:
        raise SystemExit("deltamq: error: send needs TOPIC BODY, or --file FILE")
    msg = Message(
        args.topic,
        args.body,
        tags=args.tags,
        keys=args.keys,
        delay_level=args.delay_level,
        properties=_parse_props(args.property) or None,
    )
    print(producer.send(msg, queue_key=args.queue_key))
    return 0


SKIPPED_EXIT = 3
"""Exit status of a one-shot tick or job whose lease another runner holds."""


def _tick(broker, args) -> int:
    from deltamq.errors import LeaseHeld

    if args.loop:
        n = broker.runner.loop(
            args.interval,
            args.for_s,
            on_tick=lambda r: print(r.summary(), flush=True),
            on_wait=lambda e: print(f"waiting: {e}", flush=True),
        )
        print(f"stopped after {n} ticks")
        return 0
    _ready()
    try:
        result = broker.tick(_now_arg(args.now))
    except LeaseHeld as e:
        print(f"skipped: {e}", file=sys.stderr)
        return SKIPPED_EXIT
    print(result.summary())
    return 0


def _ready() -> None:
    """Say the broker is open and the job about to run (for a harness that kills jobs at
    random times: tests/crash.py sets DELTAMQ_READY_LINE)."""
    if os.environ.get("DELTAMQ_READY_LINE"):
        print("READY", flush=True)


def _now_arg(text: str | None) -> int | None:
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


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], out=None) -> None:
    """Print rows as an aligned text table."""
    out = out or sys.stdout
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=False)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False))
    print(line.rstrip(), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip(), file=out)
    if not rows:
        print("(no rows)", file=out)


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes | bytearray):
        try:
            text = bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            return f"<{len(v)} bytes>"
        return text if len(text) <= 60 else text[:57] + "..."
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    return str(v)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
