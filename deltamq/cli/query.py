"""Commands that read the warehouse: ``sql``, ``msg``, ``dlq``, ``dq``, ``doctor`` and
``report`` (``status`` has its own module)."""

from __future__ import annotations

import argparse
import json
import sys

from deltamq.cli.format import emit, ms_to_iso, print_table, shorten
from deltamq.cli.parser import CHECK_FAILED, OK, UsageError, now_arg, refuse_unused


def sql(broker, args: argparse.Namespace) -> int:
    """The query's rows (``--limit``); an engine that rejects the query is reported by
    ``main`` on one line (exit 7)."""
    df = broker.sql(args.query, write=args.write)
    columns = list(df.columns)
    rows = [list(r) for r in (df.limit(args.limit + 1).collect() if columns else df.collect())]
    cut = len(rows) > args.limit
    if cut:
        rows = rows[: args.limit]
        # said where a script checking counts by listing rows would look too
        print(f"deltamq: the first {args.limit} rows; --limit N shows more", file=sys.stderr, flush=True)
    return emit(
        args, {"columns": columns, "rows": rows, "more_rows": cut}, lambda: print_table(columns, rows)
    )


def msg(broker, args: argparse.Namespace) -> int:
    if not args.id and not args.key:
        raise UsageError("msg show needs a message id or --key K")
    if args.id:
        refuse_unused(
            args,
            "msg show ID",
            {
                "key": ("--key (give an id or a key)", None),
                "from_time": ("--from", None),
                "to_time": ("--to", None),
            },
        )
    targets = (
        [args.id]
        if args.id
        else broker.find_by_key(
            args.key, since=now_arg(args.from_time, "--from"), until=now_arg(args.to_time, "--to")
        )
    )
    traces = [{"msg_id": mid, "events": broker.trace(mid)} for mid in targets]
    found = [t for t in traces if t["events"]]

    def render() -> None:
        if not found:
            print("no message found")
        for t in found:
            print(f"message {t['msg_id']}:")
            _print_trace(t["events"])

    return emit(args, {"messages": found}, render, OK if found else CHECK_FAILED)


def _print_trace(events) -> None:
    print_table(
        ["stored", "event", "topic", "queue", "offset", "id", "due", "groups"],
        [
            [
                ms_to_iso(e["store_ts"]),
                e["event"] + (f" — {shorten(e['error'], 80)}" if e["error"] else ""),
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
        refuse_unused(args, "dlq list", {"rate": ("--rate (it paces dlq resend)", None)})
        limit = 100 if args.limit is None else args.limit
        rows = [
            r.asDict()
            for r in broker.dead_letters(**_selection(args)).orderBy("store_ts").limit(limit).collect()
        ]
        return emit(args, {"dead_letters": rows}, lambda: _print_dead_letters(rows))
    if args.limit is not None:
        raise UsageError(
            "--limit is for dlq list; resend sends every dead letter selected (select fewer with "
            "--group, --from, --to, --id or --where)"
        )
    done = broker.resend_dead_letters(rate_per_s=args.rate, **_selection(args))
    return emit(
        args,
        {
            "selected": done.selected,
            "resent": done.resent,
            "already_resent": done.already_resent,
            "msg_ids": list(done.msg_ids),
        },
        lambda: print(
            f"selected {done.selected}, resent {done.resent}, already resent before {done.already_resent}"
            + (f"; new ids {' '.join(done.msg_ids)}" if done.msg_ids else "")
        ),
    )


def _selection(args: argparse.Namespace) -> dict:
    """The dead letters ``dlq`` lists or resends (its --group/--from/--to/--id/--where)."""
    return {
        "group": args.group,
        "since": now_arg(args.from_time, "--from"),
        "until": now_arg(args.to_time, "--to"),
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

    def render() -> None:
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

    data = {
        "run_id": result.run_id,
        "run_ts": result.run_ts,
        "success": result.success,
        "expectations": len(result.results),
        "failures": list(result.failures),
    }
    return emit(args, data, render, CHECK_FAILED if args.fail_on_error and not result.success else OK)


def doctor(broker, args: argparse.Namespace) -> int:
    from deltamq.tables.integrity import damaged_files

    damage = damaged_files(broker.warehouse)

    def render() -> None:
        for d in damage:
            print(d.describe())
        print(f"{len(damage)} damaged data file(s)" if damage else "every referenced data file is whole")

    data = {"damaged": [{**vars(d), "description": d.describe()} for d in damage]}
    return emit(args, data, render, CHECK_FAILED if damage else OK)


def report(broker, args: argparse.Namespace) -> int:
    from deltamq.report import write_html

    since, until = now_arg(args.from_time, "--from"), now_arg(args.to_time, "--to")
    if since is not None and until is not None and since >= until:
        raise UsageError(f"--from {args.from_time} is not before --to {args.to_time}: the window is empty")
    data = write_html(broker.context, args.html, since=since, until=until)
    return emit(
        args,
        {"file": args.html, "ticks": len(data["ticks"]), "totals": data["totals"]},
        lambda: print(f"wrote {args.html}: {len(data['ticks'])} ticks, totals {json.dumps(data['totals'])}"),
    )
