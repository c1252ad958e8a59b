"""``status``: the warehouse at a glance, one table per section of ``Broker.status()``
(with ``--json``: that dict, whole)."""

from __future__ import annotations

import argparse

from deltamq.cli.format import duration, emit, ms_to_iso, print_table
from deltamq.constants import is_system_topic


def status(broker, args: argparse.Namespace) -> int:
    st = broker.status()

    def render() -> None:
        for section in _SECTIONS:
            section(st)

    return emit(args, st, render)


def _users_first(topic: str) -> tuple[bool, str]:
    """Sort key: the user's topics, then the broker's (%RETRY%, %DLQ%, RMQ_SYS_...)."""
    return is_system_topic(topic), topic


def _topics_and_queues(st: dict) -> None:
    print_table(
        ["topic", "queues", "perm", "ordered"],
        [
            [t, v["queues"], v["perm"], v["ordered"]]
            for t, v in sorted(st["topics"].items(), key=lambda x: _users_first(x[0]))
        ],
    )
    print()
    print_table(
        ["topic", "queue", "min offset", "max offset", "messages"],
        [
            [q["topic"], q["queue_id"], q["min_offset"], q["max_offset"], q["max_offset"] - q["min_offset"]]
            for q in sorted(st["queues"], key=lambda q: (*_users_first(q["topic"]), q["queue_id"]))
        ],
    )
    upto = st["dispatched_version"]
    print(
        f"\nstored, not yet dispatched: {st['undispatched']} "
        + (f"(dispatched up to commit_log version {upto})" if upto >= 0 else "(nothing dispatched yet)")
    )


def _lag(st: dict) -> None:
    print("\nconsumer groups (lag = messages indexed but not yet consumed):")
    print_table(
        ["group", "kind", "mode", "subscribed to", "lag", "queues behind"],
        [
            [
                g["group"],
                g["kind"],
                g["mode"] + (", orderly" if g["orderly"] else ""),
                ", ".join(g["topics"]) or "- (not subscribed)",
                g["lag"],
                g["queues_behind"],
            ]
            for g in st["groups"]
        ],
    )
    print("\nlag per queue (next offset '-': no offset yet, the group starts the queue at 0):")
    print_table(
        ["group", "instance", "topic", "queue", "next offset", "head", "lag", "suspended until"],
        [
            [
                g["group"],
                g["client"] or "-",
                g["topic"],
                g["queue_id"],
                "-" if g["next_offset"] is None else g["next_offset"],
                g["head"],
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


def _pull_clients(st: dict) -> None:
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


def _transactions(st: dict) -> None:
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


def _delays_and_timers(st: dict) -> None:
    print("\ndelay levels (SCHEDULE_TOPIC_XXXX) with messages pending:")
    held = [lv for lv in st["levels"] if lv["pending"]]
    print_table(
        ["level", "delay", "offset", "pending", "oldest due"],
        [
            [lv["level"], duration(lv["delay_ms"]), lv["offset"], lv["pending"], ms_to_iso(lv["oldest_due"])]
            for lv in held
        ],
    )
    empty = len(st["levels"]) - len(held)
    if empty:
        print(f"({empty} of {len(st['levels'])} levels have nothing pending: not shown)")
    print("\ntimers pending by due day (rmq_sys_wheel_timer):")
    print_table(
        ["due day", "pending", "first due"],
        [[t["due_day"], t["pending"], ms_to_iso(t["first_due"])] for t in st["timers"]],
    )


def _recent_runs(st: dict) -> None:
    print("\nrecent job runs (job_runs):")
    print_table(
        ["tick now", "job", "status", "in", "out", "ms", "error"],
        [
            [ms_to_iso(r["now_ts"]), r["job"], r["status"], r["rows_in"], r["rows_out"], r["ms"], r["error"]]
            for r in st["recent_runs"]
        ],
    )


_SECTIONS = [_topics_and_queues, _lag, _pull_clients, _transactions, _delays_and_timers, _recent_runs]
