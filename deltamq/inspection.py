"""Read-only views of a warehouse: what is held, pending and in flight, per job and
per consumer group (``Broker.status``, ``deltamq status``, the report).

Every view reads; none writes or takes a lease. The jobs own their state and how it
is stored (``promote.load_state``, ``check_transactions.load_state``, the pull log);
the views here read it through those public functions and the tables' owner modules,
so a job's module holds only what the job does.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from deltamq import pull
from deltamq.constants import (
    DLQ_PREFIX,
    RETRY_PREFIX,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Prop,
    SysFlag,
)
from deltamq.jobs import check_transactions, promote
from deltamq.pull_engine import EngineStore
from deltamq.tables import commit_log, consume_queue, deliveries, deltalog
from deltamq.tables.consume_queue import DispatchState, int_prop, load_dispatch_state
from deltamq.tables.offsets import QueueKey, positions
from deltamq.tables.sqltext import sql_long

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.tables.warehouse import Warehouse

Queue = tuple[str, int]


def _new_commits(wh: Warehouse, version: int) -> list[deltalog.Commit]:
    """The commit_log commits after ``version`` (the last one dispatch indexed)."""
    return deltalog.commits_after(wh.storage, wh.uri("commit_log"), version, 1_000_000)


def _undispatched(
    wh: Warehouse, version: int, commits: list[deltalog.Commit] | None = None
) -> DataFrame | None:
    """commit_log rows stored after ``version`` (``commits``, when the caller listed them):
    messages a view counts before the next dispatch indexes them; None when there are none."""
    commits = _new_commits(wh, version) if commits is None else commits
    return commit_log.read_added(wh, commits) if commits else None


def _prepared() -> Column:
    """A commit_log row that is a transaction's half message (not a message yet)."""
    return F.col("sys_flag").bitwiseAND(F.lit(0xC)) == F.lit(SysFlag.TRANSACTION_PREPARED_TYPE)


# --- what a delete would drop ----------------------------------------------------------------
def topic_subscribers(ctx: Context, topic: str, from_queue: int = 0) -> dict[str, int]:
    """The consumer groups subscribed to ``topic`` and, for each, how many of the topic's
    messages (in queues ``from_queue`` and up) it has not consumed yet: its lag over those
    queues, and the messages stored there that dispatch has not indexed yet, as
    :func:`group_holdings` counts them."""
    groups = sorted({s.consumer_group for s in ctx.catalog.subscriptions() if s.topic == topic})
    if not groups:
        return {}
    dispatched = load_dispatch_state(ctx.warehouse)
    heads = {k: v for k, v in dispatched.heads.items() if k[0] == topic and k[1] >= from_queue}
    lag = _lag(ctx, heads)
    added = _undispatched(ctx.warehouse, dispatched.version)
    stored = 0
    if added is not None:
        mine = (F.col("topic") == F.lit(topic)) & (F.col("queue_id") >= F.lit(from_queue))
        stored = added.where(mine & ~_prepared()).count()
    return {g: stored + sum(x["lag"] for x in lag if x["group"] == g) for g in groups}


def group_holdings(ctx: Context, group: str) -> dict[str, int]:
    """What deleting ``group`` would drop: ``unconsumed`` (its lag over every topic it
    subscribes to, its promoted retries included: ``retried`` of them), ``in_retry`` (its
    retries still waiting in a delay level) and ``in_flight`` (pulled, not yet acked)."""
    wh = ctx.warehouse
    retries = RETRY_PREFIX + group
    topics = {s.topic for s in ctx.catalog.subscriptions(group)}
    dispatched = load_dispatch_state(wh)
    heads = {k: v for k, v in dispatched.heads.items() if k[0] in topics}
    lags = [x for x in _lag(ctx, heads) if x["group"] == group]
    unconsumed = sum(x["lag"] for x in lags)
    retried = sum(x["lag"] for x in lags if x["topic"] == retries)  # due again, in its retry topic
    # stored but not indexed yet (a retry written by the last tick's deliver, say)
    added = _undispatched(wh, dispatched.version)
    new_retries = 0
    if added is not None:
        # the retry copies sent back (in the group's retry topic), and the messages stored in
        # its topics (prepared halves are not messages yet; their commit copies are)
        real = F.when(_prepared(), F.lit(None)).otherwise(F.col("topic"))
        row = added.select(
            F.sum((real == retries).cast("long")).alias("r"),
            F.sum(
                (real.isin(sorted(topics - {retries})) if topics - {retries} else F.lit(False)).cast("long")
            ).alias("u"),
        ).collect()[0]
        new_retries, unconsumed = row["r"] or 0, unconsumed + (row["u"] or 0)
    state = promote.load_state(wh)
    timers = (state.timer_watermark, state.timer_next_offset)
    in_retry = new_retries + consume_queue.held_for(wh, state.level_offsets, wh.levels(), timers, retries)
    in_flight = deliveries.in_flight(wh, group)
    return {"unconsumed": unconsumed, "retried": retried, "in_retry": in_retry, "in_flight": in_flight}


# --- the warehouse at a glance ----------------------------------------------------------------
def status(ctx: Context) -> dict[str, Any]:
    """Topics, and per (topic, queue) the offsets indexed so far; messages stored
    but not yet dispatched (from the Delta commit entries' record counts); every consumer
    group (``groups``: its kind, subscriptions and total lag) and its lag per queue
    (``lag``: a queue the group has no offset row for yet — subscribed before the queue had
    messages — is read from offset 0, so its lag is the queue's head); delay levels,
    timers, dead letters, transactions, pull clients and the recent job runs."""
    state = load_dispatch_state(ctx.warehouse)
    minimums = consume_queue.minimums(ctx.warehouse)
    # a queue whose rows retention removed altogether has no minimum: its head is (as
    # retention itself counts it), so it holds no message
    lows = {k: minimums.get(k, nxt) for k, nxt in state.heads.items()}
    queues = [
        {"topic": t, "queue_id": q, "min_offset": lows[(t, q)], "max_offset": nxt}
        for (t, q), nxt in sorted(state.heads.items())
    ]
    commits = _new_commits(ctx.warehouse, state.version)
    undispatched = sum(f.num_records or 0 for c in commits for f in c.files)
    pending = held(ctx.warehouse)
    lag = group_lag(ctx, state.heads)
    # the dead letters still stored (retention removes them after dlq_reserved_time)
    dlq = {
        t: n - lows[(t, q)]
        for (t, q), n in state.heads.items()
        if t.startswith(DLQ_PREFIX) and n > lows[(t, q)]
    }
    clients = pull_clients(ctx, ctx.clock.now_ms())
    return {
        "topics": ctx.catalog.topics(),
        "queues": queues,
        "dispatched_version": state.version,
        "undispatched": undispatched,
        "levels": pending["levels"],
        "timers": pending["timers"],
        "groups": _group_summaries(ctx, lag),
        "lag": lag,
        "dead_letters": dlq,
        "transactions": transactions(ctx, ctx.clock.now_ms(), indexed=state, commits=commits),
        "pull_clients": clients,
        "recent_runs": recent_runs(ctx),
    }


def _lag(ctx: Context, heads: dict[tuple[str, int], int]) -> list[dict[str, Any]]:
    return group_lag(ctx, heads, queues=list(heads)) if heads else []


def group_lag(
    ctx: Context, heads: dict[tuple[str, int], int], queues: list[tuple[str, int]] | None = None
) -> list[dict[str, Any]]:
    """Per consumer group (and BROADCASTING instance), topic and queue: its next offset and
    lag — from its offset rows, and for each subscribed queue with messages but no offset
    row yet, from offset 0 (where deliver, pull clients and sinks start such a queue); a
    pull group's from its offsets and the deliveries log's rows not folded into them yet."""
    rows: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for key, at in positions(ctx.warehouse, queues=queues).items():
        head = heads.get((key.topic, key.queue_id), 0)
        rows[key] = {
            "group": key.group,
            "client": key.client,
            "topic": key.topic,
            "queue_id": key.queue_id,
            "next_offset": at.next_offset,
            "head": head,
            "lag": max(0, head - at.next_offset),
            "suspend_until": at.suspend_until,
        }
    groups = ctx.catalog.groups()
    for sub in ctx.catalog.subscriptions():
        cfg = groups.get(sub.consumer_group)
        for client in cfg.clients if cfg is not None else []:
            for (topic, qid), head in heads.items():
                key = QueueKey(sub.consumer_group, client, topic, qid)
                if topic != sub.topic or key in rows:
                    continue
                rows[key] = {
                    "group": sub.consumer_group,
                    "client": client or None,
                    "topic": topic,
                    "queue_id": qid,
                    "next_offset": None,  # no offset row yet: the group starts the queue at 0
                    "head": head,
                    "lag": head,
                    "suspend_until": None,
                }
    # a pull group's acks and nacks count from the moment they are stored in the deliveries
    # log, not from the tick that folds them into its offsets
    logs = deliveries.summary(ctx.warehouse, queues=queues)
    stored = deliveries.read_positions(ctx.warehouse, {g for g, _, _ in logs}) if logs else {}
    for (group, topic, qid), s in logs.items():
        row = rows.get(QueueKey(group, "", topic, qid))
        if row is not None:
            acked, _ = deliveries.position(s, stored.get((group, topic, qid)))
            row["next_offset"], row["lag"] = acked, max(0, row["head"] - acked)
    return [rows[k] for k in sorted(rows)]


def _group_summaries(ctx: Context, lag: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every consumer group, subscribed or not, with or without offset rows: its kind
    (push, sink, pull — a group with no stored listener whose clients have pulled —
    or ``pull (no client yet)``: one nobody has pulled from yet, which ``group list``
    also shows as a pull group), the topics it
    subscribed to (its own
    ``%RETRY%`` topic, which it always reads, not listed) and its lag (retries included)."""
    pulling = deliveries.pulled_groups(ctx.warehouse)
    topics: dict[str, list[str]] = {}
    for sub in ctx.catalog.subscriptions():
        if sub.topic != RETRY_PREFIX + sub.consumer_group:  # every group reads its own retries
            topics.setdefault(sub.consumer_group, []).append(sub.topic)
    out = []
    for name, cfg in sorted(ctx.catalog.groups().items()):
        if cfg.sink_table:
            kind = "sink"
        elif cfg.listener or name in ctx.catalog.listeners:
            kind = "push"
        else:
            kind = "pull" if name in pulling else "pull (no client yet)"
        mine = [x for x in lag if x["group"] == name]
        out.append(
            {
                "group": name,
                "kind": kind,
                "mode": cfg.mode,
                "orderly": cfg.orderly,
                "topics": sorted(topics.get(name, [])),
                "lag": sum(x["lag"] for x in mine),
                "queues_behind": sum(1 for x in mine if x["lag"] > 0),
            }
        )
    return out


def recent_runs(ctx: Context, limit: int = 10) -> list[dict[str, Any]]:
    """The last ``limit`` ticks' job rows (``job_runs``, read from yesterday's
    partition on when the warehouse has recent ticks)."""
    wh = ctx.warehouse
    latest = ctx.engine.rows(f"SELECT max(run_date) AS d FROM {wh.ref('job_runs')}")[0]["d"]
    if latest is None:
        return []
    recent = f"run_date >= date_sub(DATE'{latest.isoformat()}', 1)"
    # (Sail cannot ORDER BY an aggregate that is not selected: select it as t)
    rows = ctx.engine.rows(
        "SELECT r.tick_id, r.now_ts, r.job, r.status, r.rows_in, r.rows_out, "
        f"r.end_ts - r.start_ts AS ms, r.error FROM {wh.ref('job_runs')} r "
        "JOIN (SELECT tick_id, max(now_ts) AS t FROM "
        f"{wh.ref('job_runs')} WHERE {recent} GROUP BY tick_id ORDER BY t DESC LIMIT {int(limit)}) k "
        f"ON r.tick_id = k.tick_id WHERE r.{recent} ORDER BY r.now_ts DESC, r.start_ts"
    )
    return [r.asDict() for r in rows]


# --- per job ----------------------------------------------------------------------------------
def held(wh: Warehouse) -> dict[str, list[dict[str, Any]]]:
    """What is held: per level (pending, oldest due, saved offset) and timers by due day."""
    state = promote.load_state(wh)
    levels = wh.levels()
    held = consume_queue.held_levels(wh, state.level_offsets, levels)
    per_level = [
        {
            "level": lvl,
            "delay_ms": delay,
            "offset": state.level_offsets.get(lvl - 1, 0),
            "pending": held[lvl - 1][0] if lvl - 1 in held else 0,
            "oldest_due": held[lvl - 1][1] if lvl - 1 in held else None,
        }
        for lvl, delay in levels
    ]
    timers = consume_queue.held_timers(wh, state.timer_watermark, state.timer_next_offset)
    return {
        "levels": per_level,
        "timers": [{"due_day": str(day), "pending": n, "first_due": first} for day, n, first in timers],
    }


def transactions(
    ctx: Context,
    now: int,
    *,
    indexed: DispatchState | None = None,
    commits: list[deltalog.Commit] | None = None,
) -> list[dict[str, Any]]:
    """Per producer group: half messages not settled (indexed at or after the half
    offset, or stored since dispatch's last pass), the oldest age, the most checks so
    far, and messages discarded. ``indexed`` and ``commits`` (dispatch's state and the
    commits after it) when the caller has read them already."""
    wh = ctx.warehouse
    state = check_transactions.load_state(wh)
    indexed = load_dispatch_state(wh) if indexed is None else indexed
    head = indexed.heads.get((TRANS_HALF_TOPIC, 0), 0)
    ops = check_transactions.system_queue(
        wh, TRANS_OP_HALF_TOPIC, 0, indexed.heads.get((TRANS_OP_HALF_TOPIC, 0), 0)
    ).select(F.col("properties").getItem(Prop.TRAN_ID).alias("op_tran"))
    columns = ("msg_id", "properties", "born_ts", "store_ts")
    half = check_transactions.system_queue(wh, TRANS_HALF_TOPIC, state.half_offset, head).select(*columns)
    added = _undispatched(wh, indexed.version, commits)
    if added is not None:
        # halves and op records not indexed yet: a check pass's halves written again (the
        # pass moved past their old copies), a producer's newest
        half = half.unionByName(added.where(_prepared()).select(*columns))
        ops = ops.unionByName(
            added.where(F.col("topic") == F.lit(TRANS_OP_HALF_TOPIC)).select(
                F.col("properties").getItem(Prop.TRAN_ID).alias("op_tran")
            )
        )
    tran = F.coalesce(F.col("properties").getItem(Prop.TRAN_ID), F.col("msg_id"))
    live = half.withColumn("tran", tran).join(ops, F.col("tran") == F.col("op_tran"), "left_anti")
    out: dict[str, dict[str, Any]] = {}
    for r in (
        live.groupBy(F.col("properties").getItem(Prop.PGROUP).alias("pg"))
        .agg(
            F.count_distinct("tran").alias("n"),
            F.min(F.coalesce("born_ts", "store_ts")).alias("oldest_born"),
            F.max(
                F.coalesce(int_prop(F.col("properties"), Prop.TRANSACTION_CHECK_TIMES, 12), F.lit(0))
            ).alias("max_checks"),
        )
        .collect()
    ):
        out[r["pg"]] = {
            "producer_group": r["pg"],
            "pending": r["n"],
            "oldest_age_ms": now - r["oldest_born"],
            "max_checks": r["max_checks"],
            "discarded": 0,
        }
    discarded = check_transactions.engine_discards(wh, indexed.heads.get((TRANS_CHECK_MAX_TIME_TOPIC, 0), 0))
    for pg, n in discarded.items():
        out.setdefault(
            pg,
            {"producer_group": pg, "pending": 0, "oldest_age_ms": None, "max_checks": None, "discarded": 0},
        )["discarded"] = n
    return [out[k] for k in sorted(out, key=str)]


def pull_clients(ctx: Context, now: int) -> list[dict[str, Any]]:
    """Per pull group and live client: its assigned queues (the rebalance), the queues it
    holds the lock of, and its messages in flight."""
    wh = ctx.warehouse
    clients = ctx.engine.rows(
        f"SELECT consumer_group, client_id, last_seen_ts FROM {wh.ref('clients')} "
        f"WHERE last_seen_ts >= {sql_long(now - ctx.config.client_timeout_ms)} ORDER BY 1, 2"
    )
    inflight = {
        (r["consumer_group"], r["client_id"]): r["count"]
        for r in deliveries.open_deliveries(ctx.warehouse, F.lit(True))
        .groupBy("consumer_group", "client_id")
        .count()
        .collect()
    }
    owners: dict[tuple[str, str], list[Queue]] = defaultdict(list)
    for r in ctx.engine.rows(
        f"SELECT consumer_group, owner, topic, queue_id FROM {wh.ref('queue_lock')} WHERE owner IS NOT NULL"
    ):
        owners[(r["consumer_group"], r["owner"])].append((r["topic"], r["queue_id"]))
    by_group: dict[str, list[str]] = defaultdict(list)
    for r in clients:
        by_group[r["consumer_group"]].append(r["client_id"])
    out = []
    for r in clients:
        group, client = r["consumer_group"], r["client_id"]
        assigned = pull.assign(
            pull.group_queues(ctx.catalog.subscriptions(group), EngineStore(ctx).topic_queues),
            by_group[group],
            client,
        )
        out.append(
            {
                "group": group,
                "client": client,
                "last_seen": r["last_seen_ts"],
                "assigned": assigned,
                "locked": sorted(owners.get((group, client), [])),
                "in_flight": inflight.get((group, client), 0),
            }
        )
    return out
