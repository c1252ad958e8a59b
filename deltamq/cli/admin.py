"""Administration commands: ``init``, ``topic``, ``group``, ``subscribe``, ``offsets``
and ``rebuild-index``."""

from __future__ import annotations

import argparse
import json

from deltamq.cli.format import print_table
from deltamq.cli.parser import now_arg


def init(args: argparse.Namespace) -> int:
    """``init`` runs without a broker: it is the one command that creates a warehouse."""
    from deltamq.config import BrokerConfig
    from deltamq.engine import Engine
    from deltamq.tables.warehouse import Warehouse

    if not args.warehouse:
        raise SystemExit("deltamq: error: give --warehouse DIR (or set DELTAMQ_WAREHOUSE)")
    engine = Engine.open(BrokerConfig.from_env(**({"remote": args.remote} if args.remote else {})))
    done = Warehouse(engine, args.warehouse).init(args.levels)
    print(json.dumps(done))
    return 0


def topic(broker, args: argparse.Namespace) -> int:
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


def group(broker, args: argparse.Namespace) -> int:
    if args.action == "list":
        print_table(
            ["group", "mode", "orderly", "max reconsume", "consume from", "listener"],
            [
                [g, r.mode, r.orderly, r.max_reconsume_times, r.consume_from, r.listener]
                for g, r in broker.groups().items()
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


def subscribe(broker, args: argparse.Namespace) -> int:
    broker.subscribe(args.group, args.topic, args.expression, args.type)
    print(f"subscribed {args.group} to {args.topic} ({args.type} {args.expression})")
    return 0


def offsets(broker, args: argparse.Namespace) -> int:
    new = broker.reset_offsets(args.group, now_arg(args.to_time))
    print_table(["topic", "queue", "next offset"], [[t, q, o] for (t, q), o in sorted(new.items())])
    return 0


def rebuild_index(broker, args: argparse.Namespace) -> int:
    print(json.dumps(broker.rebuild_index()))
    return 0
