"""What ``deltamq report`` shows, read from the warehouse (``deltamq/report.py`` draws it).

Over the window [since, until) asked:

- **per tick**, from ``job_runs`` (read by its ``run_date`` partitions, one aggregate
  statement): messages indexed, deliver's outcomes (consumed, filtered, deduplicated,
  sent back for retry, dead-lettered, listener errors), the push groups' backlog when
  deliver began, pull deliveries expired, sink merges, and each job's duration;
- **per topic and time bucket**, from ``consume_queue`` (pruned by topic partition and
  by ``cl_batch_id``, which sorts by store time): messages that arrived on each user topic,
  each group's retry topic (retries due again) and dead-letter topic;
- the most recent dead letters (``ops.dead_letters``) and the job runs that failed or
  carried listener errors.

Now (cost independent of the history): the queue heads (``load_dispatch_state``) and
every group's offsets — its lag per queue and the store time of the oldest message it
has not consumed — and the transactions pending (``inspection.transactions``).

Each deliver pass records every push group's backlog when it began (``job_runs.details``
``backlog.<group>``), so lag over time is per group; pull and sink groups have their lag
now only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltamq import ids
from deltamq.clock import ms_to_iso
from deltamq.constants import DLQ_PREFIX, JOB_STEPS, RETRY_PREFIX, is_system_topic
from deltamq.inspection import group_lag, transactions
from deltamq.jobs.deliver_result import BACKLOG_KEY
from deltamq.tables import consume_queue, deliveries
from deltamq.tables.consume_queue import load_dispatch_state
from deltamq.tables.ranges import queue_ranges
from deltamq.tables.sqltext import sql_in, sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.context import Context

# deliver's per-tick outcome counts (``job_runs.details`` of its row)
DELIVER_COUNTS = ("consumed", "filtered", "deduplicated", "retried", "dead_lettered", "listener_errors")
# flows summed over the window (``totals``); a level such as the backlog is never summed
FLOWS = ("indexed", *DELIVER_COUNTS, "expired", "sunk")
STEPS = tuple(step for step, _ in JOB_STEPS)
# bucket widths for per-topic arrivals: the smallest giving at most ~120 buckets
_BUCKETS_MS = (1_000, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000, 3_600_000, 6 * 3_600_000, ids.DAY_MS)


def collect(
    ctx: Context,
    *,
    since: int | None = None,
    until: int | None = None,
    now: int | None = None,
    recent: int = 20,
) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able values (see the module docstring).
    ``now``: the time lag and ages are measured at (default: the context's clock)."""
    now = ctx.clock.now_ms() if now is None else int(now)
    ticks = _ticks(ctx, since, until)
    times = [t["now_ts"] for t in ticks]
    series = {name: [t[name] for t in ticks] for name in (*FLOWS, "backlog", "failed", "errors")}
    backlog_by_group = _backlog_by_group(ctx, since, until, times)
    durations = {
        step: [t[f"{step}_ms"] for t in ticks]
        for step in STEPS
        if any(t[f"{step}_ms"] is not None for t in ticks)
    }
    state = load_dispatch_state(ctx.warehouse)
    groups = ctx.catalog.groups()
    pulling = deliveries.pulled_groups(ctx.warehouse)
    kinds = {g: _kind(cfg, g in ctx.catalog.listeners, g in pulling) for g, cfg in groups.items()}
    subscriptions = ctx.catalog.subscriptions()
    hi = until if until is not None else max([now + 1, *(t + 1 for t in times)])
    lo, arrivals = None, _no_arrivals()
    start = since if since is not None else (times[0] if times else None)
    if start is not None:
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        width = bucket_ms(hi - start, gaps[len(gaps) // 2] if gaps else 0)
        # no window asked: from one interval before the first tick (what that tick indexed)
        lo = start if since is not None else start - width
        arrivals = _arrivals(ctx, state.heads, lo, hi, width)
    lag = _lag(ctx, state.heads, now)
    topics = {t: v for t, v in ctx.catalog.topics().items() if not is_system_topic(t)}
    in_window = arrivals["totals"]
    return {
        "warehouse": ctx.warehouse.location,
        "now": now,
        "now_iso": ms_to_iso(now),
        "window": {
            "since": since,
            "until": until,
            "from": ms_to_iso(lo) if lo is not None else None,
            "to": ms_to_iso(min(hi, now) if until is None else hi),
        },
        "ticks": [ms_to_iso(t) for t in times],
        "now_ts": times,
        "series": series,
        "backlog_by_group": backlog_by_group,
        "durations_ms": durations,
        "totals": {name: sum(v or 0 for v in series[name]) for name in FLOWS},
        "last_tick": ticks[-1]["now_ts"] if ticks else None,
        "arrivals": arrivals,
        "topics": [
            {
                "topic": t,
                "queues": v["queues"],
                "perm": v["perm"],
                "ordered": bool(v["ordered"]),
                "indexed": sum(n for (topic, _), n in state.heads.items() if topic == t),
                "in_window": in_window.get(t, 0),
            }
            for t, v in topics.items()
        ],
        "groups": _groups(groups, kinds, subscriptions, lag, state.heads, in_window, now),
        "lag": lag,
        "dead_letters": _recent_dead_letters(ctx, since, until, recent),
        "transactions": transactions(ctx, now),
        "errors": _errors(ctx, since, until, recent) if any(series["errors"]) else [],
    }


# --- per tick ---------------------------------------------------------------------------------
def window_predicate(since: int | None, until: int | None) -> str:
    """``job_runs`` rows of ticks in [since, until): by ``run_date`` partition, then ``now_ts``."""
    where = ["1 = 1"]
    if since is not None:
        where.append(
            f"run_date >= DATE'{ids.store_date(int(since)).isoformat()}' AND now_ts >= {sql_long(since)}"
        )
    if until is not None:
        where.append(
            f"run_date <= DATE'{ids.store_date(int(until)).isoformat()}' AND now_ts < {sql_long(until)}"
        )
    return " AND ".join(where)


def _ticks(ctx: Context, since: int | None, until: int | None) -> list[dict[str, Any]]:
    """One row per tick: its flows, the backlog, failures and each step's duration."""

    def deliver(key: str) -> str:
        return (
            f"sum(CASE WHEN job IN ('deliver', 'redeliver') THEN coalesce(details[{sql_str(key)}], 0) "
            f"ELSE 0 END) AS {key}"
        )

    def rows_out(jobs: tuple[str, ...], name: str) -> str:
        return f"sum(CASE WHEN job IN {sql_in(jobs)} THEN coalesce(rows_out, 0) ELSE 0 END) AS {name}"

    columns = [
        "now_ts",
        # promote indexes its copies itself in a tick (details['indexed'])
        "sum(CASE WHEN job IN ('dispatch', 'redispatch') THEN coalesce(rows_out, 0) "
        "WHEN job = 'promote' THEN coalesce(details['indexed'], 0) ELSE 0 END) AS indexed",
        *(deliver(k) for k in DELIVER_COUNTS),
        "max(CASE WHEN job = 'deliver' THEN details['backlog'] END) AS backlog",
        rows_out(("pull_expiry",), "expired"),
        rows_out(("sink",), "sunk"),
        "sum(CASE WHEN status = 'FAILED' THEN 1 ELSE 0 END) AS failed",
        "sum(CASE WHEN error IS NOT NULL THEN 1 ELSE 0 END) AS errors",
        *(
            f"sum(CASE WHEN job = {sql_str(step)} AND status <> 'SKIPPED' THEN end_ts - start_ts END) "
            f"AS {step}_ms"
            for step in STEPS
        ),
    ]
    rows = ctx.engine.rows(
        f"SELECT {', '.join(columns)} FROM {ctx.warehouse.ref('job_runs')} "
        f"WHERE {window_predicate(since, until)} GROUP BY tick_id, now_ts ORDER BY now_ts"
    )
    return [r.asDict() for r in rows]


def _backlog_by_group(
    ctx: Context, since: int | None, until: int | None, times: list[int]
) -> dict[str, list[int | None]]:
    """Each push group's lag when each deliver pass of the window began (deliver records
    it in ``job_runs.details`` as ``backlog.<group>``), aligned with ``times`` (None: the
    group took nothing that tick)."""
    if not times:
        return {}
    rows = ctx.engine.rows(
        f"SELECT now_ts, k, v FROM (SELECT now_ts, explode(details) AS (k, v) FROM "
        f"{ctx.warehouse.ref('job_runs')} WHERE {window_predicate(since, until)} AND job = 'deliver') "
        f"WHERE k LIKE {sql_str(BACKLOG_KEY + '%')}"
    )
    at = {t: i for i, t in enumerate(times)}
    out: dict[str, list[int | None]] = {}
    for r in rows:
        if r["now_ts"] in at:
            group = r["k"][len(BACKLOG_KEY) :]
            out.setdefault(group, [None] * len(times))[at[r["now_ts"]]] = r["v"]
    return dict(sorted(out.items()))


def _errors(ctx: Context, since: int | None, until: int | None, limit: int) -> list[dict[str, Any]]:
    """The latest job runs that failed or carried listener errors."""
    rows = ctx.engine.rows(
        f"SELECT now_ts, job, status, error FROM {ctx.warehouse.ref('job_runs')} "
        f"WHERE {window_predicate(since, until)} AND error IS NOT NULL "
        f"ORDER BY now_ts DESC LIMIT {int(limit)}"
    )
    return [{**r.asDict(), "time": ms_to_iso(r["now_ts"])} for r in rows]


# --- per topic and time bucket ----------------------------------------------------------------
def bucket_ms(span_ms: int, at_least: int = 0) -> int:
    """The width of the buckets arrivals are counted in: at most ~120 over ``span_ms``, and
    no narrower than ``at_least`` (the usual tick interval: what one tick indexes)."""
    return next((b for b in _BUCKETS_MS if span_ms / b <= 120 and b >= at_least), _BUCKETS_MS[-1])


def _no_arrivals() -> dict[str, Any]:
    return {"bucket_ms": None, "start_ts": [], "topics": {}, "totals": {}}


def _arrivals(
    ctx: Context, heads: dict[tuple[str, int], int], lo: int, hi: int, width: int
) -> dict[str, Any]:
    """Messages indexed on each user, retry and dead-letter topic per bucket of [lo, hi),
    by store time: one aggregate over the topics' partitions, pruned by ``cl_batch_id``."""
    topics = sorted(
        {t for t, _ in heads if not is_system_topic(t) or t.startswith((RETRY_PREFIX, DLQ_PREFIX))}
    )
    start = lo - lo % width
    if not topics:
        return {**_no_arrivals(), "bucket_ms": width}
    counts = consume_queue.arrivals(ctx.warehouse, topics, start, lo, hi, width)
    buckets = range((hi - start + width - 1) // width)
    return {
        "bucket_ms": width,
        "start_ts": [start + k * width for k in buckets],
        "topics": {t: [counts[t].get(k, 0) for k in buckets] for t in sorted(counts)},
        "totals": {t: sum(c.values()) for t, c in counts.items()},
    }


# --- now --------------------------------------------------------------------------------------
def _lag(ctx: Context, heads: dict[tuple[str, int], int], now: int) -> list[dict[str, Any]]:
    """Per group (and client) and queue: its offset, the head, the lag and the store time of
    the oldest message it has not consumed (one query over the pending rows)."""
    wh = ctx.warehouse
    out = []
    # the same rows as `deltamq status`: offset rows, and subscribed queues without one yet
    for r in group_lag(ctx, heads):
        out.append(
            {
                "group": r["group"],
                "client": r["client"] or "",
                "topic": r["topic"],
                "queue_id": r["queue_id"],
                "next_offset": r["next_offset"] or 0,
                "head": r["head"],
                "lag": r["lag"],
                "suspended": bool(r["suspend_until"] and r["suspend_until"] > now),
                "oldest_ts": None,
            }
        )
    behind = [(i, x) for i, x in enumerate(out) if x["lag"] > 0]
    if behind:
        from pyspark.sql import functions as F

        # the pending rows only: [lowest offset of any group, head) per queue, which file
        # statistics prune; then each group's own offset
        spans: dict[tuple[str, int], tuple[int, int]] = {}
        for _, x in behind:
            key = (x["topic"], x["queue_id"])
            spans[key] = (min(x["next_offset"], spans.get(key, (x["next_offset"], 0))[0]), x["head"])
        pending = (
            wh.read("consume_queue")
            .where(queue_ranges((t, q, lo, hi) for (t, q), (lo, hi) in sorted(spans.items())))
            .select("topic", "queue_id", "queue_offset", "store_ts")
        )
        positions = ctx.engine.spark.createDataFrame(
            [(i, x["topic"], x["queue_id"], x["next_offset"]) for i, x in behind],
            "i int, t string, q int, o bigint",
        )
        on = (
            (F.col("topic") == F.col("t"))
            & (F.col("queue_id") == F.col("q"))
            & (F.col("queue_offset") >= F.col("o"))
        )
        for row in pending.join(positions, on).groupBy("i").agg(F.min("store_ts").alias("oldest")).collect():
            out[row["i"]]["oldest_ts"] = row["oldest"]
    for x in out:
        x["oldest_age_ms"] = None if x["oldest_ts"] is None else max(0, now - x["oldest_ts"])
    return out


def _kind(cfg: Any, registered: bool, pulling: bool) -> str:
    if cfg.sink_table:
        return "sink"
    if cfg.listener or registered:
        return "push"
    return "pull" if pulling else "pull (no client yet)"


def _groups(
    groups: dict[str, Any],
    kinds: dict[str, str],
    subscriptions: list[Any],
    lag: list[dict[str, Any]],
    heads: dict[tuple[str, int], int],
    in_window: dict[str, int],
    now: int,
) -> list[dict[str, Any]]:
    """Per consumer group: kind, subscriptions, lag now, the oldest pending message's age,
    suspended queues, retries and dead letters."""
    out = []
    for name, cfg in sorted(groups.items()):
        rows = [x for x in lag if x["group"] == name]
        oldest = [x["oldest_ts"] for x in rows if x["oldest_ts"] is not None]
        out.append(
            {
                "group": name,
                "kind": kinds[name],
                "mode": cfg.mode + (", orderly" if cfg.orderly else ""),
                "topics": sorted({s.topic for s in subscriptions if s.consumer_group == name}),
                "lag": sum(x["lag"] for x in rows),
                "queues_behind": sum(1 for x in rows if x["lag"] > 0),
                "suspended": sum(1 for x in rows if x["suspended"]),
                "oldest_ts": min(oldest) if oldest else None,
                "oldest_age_ms": max(0, now - min(oldest)) if oldest else None,
                "retries_in_window": in_window.get(RETRY_PREFIX + name, 0),
                "dead_letters_in_window": in_window.get(DLQ_PREFIX + name, 0),
                "dead_letters": sum(n for (t, _), n in heads.items() if t == DLQ_PREFIX + name),
            }
        )
    return out


def _recent_dead_letters(
    ctx: Context, since: int | None, until: int | None, limit: int
) -> list[dict[str, Any]]:
    from pyspark.sql import functions as F

    from deltamq import ops

    rows = (
        ops.dead_letters(ctx, since=since, until=until)
        .orderBy(F.col("store_ts").desc(), F.col("msg_id"))
        .limit(int(limit))
        .collect()
    )
    resent = ops.resent_as(ctx, [r.asDict() for r in rows])
    return [
        {
            "time": ms_to_iso(r["store_ts"]),
            "store_ts": r["store_ts"],
            "group": r["consumer_group"],
            "topic": r["original_topic"],
            "reason": r["reason"],
            "reconsume_times": r["reconsume_times"],
            "last_error": r["last_error"],
            "keys": r["keys"],
            "msg_id": r["msg_id"],
            "origin_id": r["origin_id"],
            "resent_as": resent.get(r["msg_id"]),
        }
        for r in rows
    ]
