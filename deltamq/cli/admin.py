"""Administration commands: ``init``, ``topic``, ``group``, ``subscribe``, ``offsets``
and ``rebuild-index``."""

from __future__ import annotations

import argparse

from deltamq.cli.format import emit, ms_to_iso, print_table
from deltamq.cli.parser import UsageError, now_arg, refuse_unused


def init(args: argparse.Namespace) -> int:
    """``init`` runs without a broker: it is the one command that creates a warehouse."""
    from deltamq.config import BrokerConfig
    from deltamq.engine import Engine
    from deltamq.tables.warehouse import Warehouse

    if not args.warehouse:
        raise UsageError("give --warehouse DIR (or set DELTAMQ_WAREHOUSE)")
    config = BrokerConfig.from_env(**({"remote": args.remote} if args.remote else {}))
    engine = Engine.open(config)
    done = Warehouse(engine, args.warehouse, storage_options=config.storage_options).init(
        args.levels, config=config
    )

    def render() -> None:
        if done["created"]:
            print(f"created {len(done['created'])} tables in {args.warehouse}: {', '.join(done['created'])}")
        for table, columns in done["upgraded"].items():
            print(f"upgraded {table}: added {', '.join(columns)}")
        if done["levels"] and not done["created"]:
            print(f"delay levels are now: {done['levels']}")
        if not done["created"] and not done["upgraded"] and not done["levels"]:
            print(f"warehouse {args.warehouse} is up to date: nothing to create or upgrade")

    return emit(args, {"warehouse": args.warehouse, **done}, render)


def topic(broker, args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.name:
            raise UsageError(f"topic list takes no topic name (got {args.name!r}); it lists every topic")
        topics = [{"topic": t, **v} for t, v in broker.topics().items()]
        return emit(
            args,
            {"topics": topics},
            lambda: print_table(
                ["topic", "queues", "perm", "ordered"],
                [[t["topic"], t["queues"], t["perm"], t["ordered"]] for t in topics],
            ),
        )
    if not args.name:
        raise UsageError(f"topic {args.action} needs a topic name")
    if args.action == "delete":
        refuse_unused(
            args,
            "topic delete",
            {"queues": ("--queues", None), "perm": ("--perm", None), "ordered": ("--ordered", None)},
        )
    if args.action == "create":
        broker.create_topic(args.name, args.queues, args.perm or "RW", ordered=bool(args.ordered))
    elif args.action == "update":
        if args.queues is None and args.perm is None and args.ordered is None:
            raise UsageError("topic update needs what to change: --queues, --perm or --ordered")
        broker.update_topic(
            args.name, queues=args.queues, perm=args.perm, ordered=args.ordered, force=args.force
        )
    else:
        broker.delete_topic(args.name, force=args.force)
    done = f"{args.action}d"
    return emit(args, {"topic": args.name, "done": done}, lambda: print(f"topic {done}: {args.name}"))


_GROUP_UPDATE = {
    "listener": ("--listener", None),
    "max_reconsume_times": ("--max-reconsume-times", None),
    "instances": ("--instances", None),
}
_GROUP_CREATE_ONLY = {
    "mode": ("--mode", "CLUSTERING"),
    "orderly": ("--orderly", False),
    "consume_from": ("--consume-from", "LAST_OFFSET"),
    "consume_timestamp": ("--consume-timestamp", None),
}


def group(broker, args: argparse.Namespace) -> int:
    if args.action != "create":
        refuse_unused(args, f"group {args.action}", _GROUP_CREATE_ONLY)
    if args.action not in ("create", "update"):
        refuse_unused(args, f"group {args.action}", _GROUP_UPDATE)
    if args.action == "update":
        return _group_update(broker, args)
    if args.action == "list":
        if args.name:
            raise UsageError(f"group list takes no group name (got {args.name!r}); it lists every group")
        groups = [
            {
                "group": g,
                "mode": r.mode,
                "orderly": r.orderly,
                "max_reconsume_times": r.max_reconsume_times,
                "consume_from": r.consume_from,
                "listener": r.listener,
                "sink_table": r.sink_table,
            }
            for g, r in broker.groups().items()
        ]
        return emit(
            args,
            {"groups": groups},
            lambda: print_table(
                ["group", "mode", "orderly", "max reconsume", "consume from", "listener"],
                [
                    [
                        g["group"],
                        g["mode"],
                        g["orderly"],
                        g["max_reconsume_times"],
                        g["consume_from"],
                        g["listener"] or (f"sink {g['sink_table']}" if g["sink_table"] else "- (pull)"),
                    ]
                    for g in groups
                ],
            ),
        )
    if not args.name:
        raise UsageError(f"group {args.action} needs a group name")
    if args.action == "create":
        broker.create_group(
            args.name,
            args.listener,
            mode=args.mode,
            orderly=args.orderly,
            max_reconsume_times=args.max_reconsume_times,
            consume_from=args.consume_from,
            consume_timestamp=now_arg(args.consume_timestamp, "--consume-timestamp"),
            instances=_instances(args),
        )
    else:
        broker.delete_group(args.name, force=args.force)
    done = f"{args.action}d"
    return emit(args, {"group": args.name, "done": done}, lambda: print(f"group {done}: {args.name}"))


def _instances(args: argparse.Namespace) -> list[str] | None:
    return [i.strip() for i in args.instances.split(",") if i.strip()] if args.instances else None


def _group_update(broker, args: argparse.Namespace) -> int:
    if not args.name:
        raise UsageError("group update needs a group name")
    if args.listener is None and args.max_reconsume_times is None and args.instances is None:
        raise UsageError(
            "group update needs what to change: --listener, --max-reconsume-times or --instances"
        )
    changed = broker.update_group(
        args.name, args.listener, max_reconsume_times=args.max_reconsume_times, instances=_instances(args)
    )
    shown = {k: {"old": _plain(old), "new": _plain(new)} for k, (old, new) in changed.items()}

    def render() -> None:
        if not changed:
            print(f"group {args.name}: nothing to change, the settings given are the stored ones")
        for k, v in shown.items():
            print(f"group {args.name}: {k} {v['old']} -> {v['new']}")

    return emit(args, {"group": args.name, "done": "updated", "changed": shown}, render)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def catalog(broker, args: argparse.Namespace) -> int:
    mode = broker.engine.mode
    in_memory = mode == "classic" and broker.spark.conf.get("spark.sql.catalogImplementation", "") != "hive"
    if mode == "embedded" or in_memory:
        where = "the embedded engine's catalog" if mode == "embedded" else "an in-memory catalog (no Hive)"
        raise UsageError(
            f"catalog register without --remote would name the tables in {where}, which ends "
            "with this command: nothing would remain. Give --remote "
            "sc://host:port (or DELTAMQ_SPARK_REMOTE) for a Spark Connect server's catalog, or "
            "call deltamq.register(spark, warehouse) in the session that queries them"
        )
    if broker.engine.flavor == "sail":  # Sail keeps databases and tables per session (docs/engines.md)
        raise UsageError(
            "catalog register on a Sail server would name the tables in this command's own "
            "session: Sail keeps its catalog per session, so no other session would see them "
            "and nothing would remain. Call deltamq.register(spark, warehouse) in the session "
            "that queries them, or give --remote an Apache Spark Connect server"
        )
    names = broker.register(args.database)
    return emit(
        args,
        {"database": args.database, "registered": names},
        lambda: print(f"registered {len(names)} tables and views in {args.database}: {', '.join(names)}"),
    )


def subscribe(broker, args: argparse.Namespace) -> int:
    old = broker.subscribe(args.group, args.topic, args.expression, args.type)
    replaced = f"; it replaces {old.expr_type} {old.expression}" if old is not None else ""
    return emit(
        args,
        {
            "group": args.group,
            "topic": args.topic,
            "type": args.type,
            "expression": args.expression,
            "replaced": None if old is None else {"type": old.expr_type, "expression": old.expression},
        },
        lambda: print(f"subscribed {args.group} to {args.topic} ({args.type} {args.expression}){replaced}"),
    )


def unsubscribe(broker, args: argparse.Namespace) -> int:
    broker.unsubscribe(args.group, args.topic)
    return emit(
        args,
        {"group": args.group, "topic": args.topic},
        lambda: print(f"unsubscribed {args.group} from {args.topic}"),
    )


def offsets(broker, args: argparse.Namespace) -> int:
    to_time = now_arg(args.to_time, "--to-time")
    new = broker.reset_offsets(args.group, to_time)
    rows = [{"topic": t, "queue_id": q, "next_offset": o} for (t, q), o in sorted(new.items())]

    def render() -> None:
        print(f"offsets of {args.group} reset to the first message stored at or after {ms_to_iso(to_time)}:")
        print_table(
            ["topic", "queue", "next offset"], [[r["topic"], r["queue_id"], r["next_offset"]] for r in rows]
        )

    return emit(args, {"group": args.group, "to_time": to_time, "offsets": rows}, render)


def rebuild_index(broker, args: argparse.Namespace) -> int:
    done = broker.rebuild_index()
    return emit(
        args,
        done,
        lambda: print_table(
            ["rows before", "rows after", "dispatch passes", "indexed"],
            [[done["rows_before"], done["rows_after"], done["passes"], done["indexed"]]],
        ),
    )
