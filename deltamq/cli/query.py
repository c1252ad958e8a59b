"""Commands that read the warehouse: ``sql``, ``msg``, ``dlq``, ``dq``, ``doctor`` and
``report`` (``status`` has its own module)."""

from __future__ import annotations

import argparse
import json

from deltamq.cli.format import ms_to_iso, print_table
from deltamq.cli.parser import now_arg


def sql(broker, args: argparse.Namespace) -> int:
    df = broker.sql(args.query, write=args.write)
    rows = df.limit(args.limit).collect() if df.columns else df.collect()
    print_table(df.columns, [list(r) for r in rows])
    return 0


def msg(broker, args: argparse.Namespace) -> int:
    if not args.id and not args.key:
        raise SystemExit("deltamq: error: msg show needs a message id or --key K")
    targets = (
        [args.id]
        if args.id
        else broker.find_by_key(args.key, since=now_arg(args.from_time), until=now_arg(args.to_time))
    )
    if not targets:
        print("no message found")
        return 1
    for mid in targets:
        print(f"message {mid}:")
        _print_trace(broker.trace(mid))
    return 0


def _print_trace(events) -> None:
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
            for e in events
        ],
    )


def dlq(broker, args: argparse.Namespace) -> int:
    if args.action == "list":
        rows = broker.dead_letters(**_selection(args)).orderBy("store_ts").limit(args.limit).collect()
        _print_dead_letters(rows)
        return 0
    done = broker.resend_dead_letters(rate_per_s=args.rate, **_selection(args))
    print(
        f"selected {done.selected}, resent {done.resent}, already resent before {done.already_resent}"
        + (f"; new ids {' '.join(done.msg_ids)}" if done.msg_ids else "")
    )
    return 0


def _selection(args: argparse.Namespace) -> dict:
    """The dead letters ``dlq`` lists or resends (its --group/--from/--to/--id/--where)."""
    return {
        "group": args.group,
        "since": now_arg(args.from_time),
        "until": now_arg(args.to_time),
        "msg_ids": args.id or None,
        "where": args.where,
    }


def _print_dead_letters(rows) -> None:
    print_table(
        ["group", "dead letter", "original id", "topic", "reason", "retries", "stored", "keys", "last error"],
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


def dq(broker, args: argparse.Namespace) -> int:
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


def doctor(broker, args: argparse.Namespace) -> int:
    from deltamq.tables.integrity import damaged_files

    damage = damaged_files(broker.warehouse)
    for d in damage:
        print(d.describe())
    print(f"{len(damage)} damaged data file(s)" if damage else "every referenced data file is whole")
    return 1 if damage else 0


def report(broker, args: argparse.Namespace) -> int:
    from deltamq.report import write_html

    data = write_html(broker, args.html, since=now_arg(args.from_time), until=now_arg(args.to_time))
    print(f"wrote {args.html}: {len(data['ticks'])} ticks, totals {json.dumps(data['totals'])}")
    return 0
