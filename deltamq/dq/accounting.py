"""The conservation check: every message accounted for, per consumer group.

For each group (each instance of a BROADCASTING group) and each message of a topic it
subscribes to that matches its subscription, exactly one state:

- ``held``: delayed or timed, not yet due (its schedule/timer entry not promoted);
- ``pending``: visible, the group's offset has not passed it (pull groups: not acked);
- ``consumed``: the offset passed it and it was not sent back, or its last retry was
  passed without being sent back again;
- ``retrying``: sent back, its latest retry waiting (held) or visible in ``%RETRY%<group>``
  and not yet passed;
- ``dead_lettered``: its copy is in ``%DLQ%<group>``;
- ``expired``: below the queue's retained minimum (retention).

A message fits none when its chain is broken — these are *unaccounted*, reported by id:
a delayed message or retry the schedule service passed (promoted) whose promoted copy is
not in the index, or a retry stage missing below a later one (a retry copy deleted).
RocketMQ users cannot run this query: their offsets, retry topics and schedule
queues live in different files with no common key. Here every copy keeps the message's
``UNIQ_KEY`` and its retry count, so the whole chain is one table.

Cost: one narrow projection of ``consume_queue`` (no bodies) collected and walked once;
see bench/README.md for 1M messages.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from deltamq.constants import (
    DLQ_PREFIX,
    RETRY_PREFIX,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    Prop,
    is_system_topic,
)
from deltamq.filters import subscriptions_filter
from deltamq.tables.offsets import QueueKey, group_positions

if TYPE_CHECKING:
    from deltamq.config import GroupConfig, Subscription
    from deltamq.context import Context
    from deltamq.jobs.promote import PromoteState
    from deltamq.tables.warehouse import Warehouse

STATES = ("held", "pending", "consumed", "retrying", "dead_lettered", "expired")
_SAMPLE = 20


@dataclass
class GroupAccount:
    group: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    unaccounted: list[tuple[str, str]] = field(default_factory=list)  # (message id, why)


@dataclass(frozen=True)
class Accounting:
    groups: tuple[GroupAccount, ...]
    lost_in_promotion: tuple[tuple[str, str], ...]  # (message id, why): for every group

    @property
    def unaccounted(self) -> list[tuple[str, str, str]]:
        """(group or '*', message id, why)."""
        out = [("*", m, why) for m, why in self.lost_in_promotion]
        for g in self.groups:
            out += [(g.group, m, why) for m, why in g.unaccounted]
        return out

    @property
    def ok(self) -> bool:
        return not self.unaccounted


def _held_passed(row: dict[str, Any], promote) -> bool:
    """True if the schedule service has passed (promoted) this schedule/timer entry."""
    if row["topic"] == SCHEDULE_TOPIC:
        return row["queue_offset"] < promote.level_offsets.get(row["queue_id"], 0)
    return (row["due_ts"] or 0) <= promote.timer_watermark and row["queue_offset"] < promote.timer_next_offset


def account(ctx: Context) -> Accounting:
    """Walk every group's messages and their copies (see the module doc)."""
    from deltamq.jobs import promote as promote_job

    wh = ctx.warehouse
    groups = ctx.catalog.groups()
    order = sorted(groups)
    subs = [s for s in ctx.catalog.subscriptions() if s.consumer_group in groups]
    promote = promote_job.load_state(wh)
    rows = _index_rows(wh, order, subs)
    offsets = group_positions(wh)
    chains = _sort_rows(rows)
    still_held, lost = _held_originals(chains, promote)
    accounts = []
    for gi, g in enumerate(order):
        accounts += _group_accounts(gi, groups[g], subs, chains, still_held, offsets, promote)
    return Accounting(tuple(accounts), tuple(lost))


def _index_rows(wh: Warehouse, order: list[str], subs: list[Subscription]) -> list[Any]:
    """The narrow projection of ``consume_queue`` the walk needs (no bodies), collected:
    each row's message id (``uid``), retry count (``k``) and real topic, and per group
    ``order[gi]`` whether it matches the group's subscriptions to user topics (``m<gi>``)."""
    props = F.col("properties")
    cq = wh.read("consume_queue")
    flags = [
        subscriptions_filter(s for s in subs if s.consumer_group == g and not is_system_topic(s.topic)).alias(
            f"m{gi}"
        )
        for gi, g in enumerate(order)
    ]
    return cq.select(
        "topic",
        "queue_id",
        "queue_offset",
        "msg_id",
        F.coalesce(props.getItem(Prop.UNIQ_KEY), F.col("msg_id")).alias("uid"),
        F.coalesce(F.col("reconsume_times"), F.lit(0)).alias("k"),
        props.getItem(Prop.REAL_TOPIC).alias("real_topic"),
        "due_ts",
        *flags,
    ).collect()


@dataclass(frozen=True)
class _Chains:
    """The index rows sorted for the walk (by :func:`_sort_rows`)."""

    originals: list[Any]  # rows of user topics
    visible: set[tuple[str, str, int]]  # (uid, topic, k) present in a readable topic
    copies: dict[str, dict[str, list[Any]]]  # group -> uid -> (kind, row): held, retry or dlq
    held_originals: dict[str, Any]  # uid -> the schedule/timer entry of a delayed or timed original


def _sort_rows(rows: list[Any]) -> _Chains:
    """Sort the index rows: originals (user topics), the groups' copies (retries waiting in
    the schedule/timer topics, retry topics, DLQs) and delayed or timed originals."""
    originals: list[Any] = []
    visible: set[tuple[str, str, int]] = set()  # (uid, topic, k) present in a readable topic
    copies: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))  # group -> uid -> rows
    held_originals: dict[str, Any] = {}
    for r in rows:
        topic = r["topic"]
        if topic in (SCHEDULE_TOPIC, TIMER_TOPIC):
            real = r["real_topic"] or ""
            if real.startswith(RETRY_PREFIX):
                copies[real[len(RETRY_PREFIX) :]][r["uid"]].append(("held", r))
            elif r["msg_id"] == r["uid"] and not is_system_topic(real):
                held_originals[r["uid"]] = r
        elif topic.startswith(RETRY_PREFIX):
            copies[topic[len(RETRY_PREFIX) :]][r["uid"]].append(("retry", r))
            visible.add((r["uid"], topic, r["k"]))
        elif topic.startswith(DLQ_PREFIX):
            copies[topic[len(DLQ_PREFIX) :]][r["uid"]].append(("dlq", r))
        elif not is_system_topic(topic):
            originals.append(r)
            visible.add((r["uid"], topic, r["k"]))
    return _Chains(originals, visible, copies, held_originals)


def _held_originals(chains: _Chains, promote: PromoteState) -> tuple[list[Any], list[tuple[str, str]]]:
    """The delayed or timed originals still held, and those lost in promotion (message id, why).

    A delayed message the schedule service passed must be visible in its real topic; one
    it has not passed is held (for every group subscribed to that topic).
    """
    still_held: list[Any] = []
    lost: list[tuple[str, str]] = []
    for uid, r in chains.held_originals.items():
        if (uid, r["real_topic"], r["k"]) in chains.visible:
            continue
        if _held_passed(r, promote):
            lost.append((uid, f"promoted from {r['topic']} but not in {r['real_topic']}"))
        else:
            still_held.append(r)
    return still_held, lost


def _group_accounts(
    gi: int,
    cfg: GroupConfig,
    subs: list[Subscription],
    chains: _Chains,
    still_held: list[Any],
    offsets: dict[QueueKey, int],
    promote: PromoteState,
) -> list[GroupAccount]:
    """The accounts of group ``cfg`` (the ``gi``-th by name): one, or one per instance of a
    BROADCASTING group. Each original it subscribes to is pending (its offset has not
    passed it) or in the state its copies tell (:func:`_after_pass`); the held originals of
    its topics are held."""
    g = cfg.name
    clients = list(cfg.instances or []) if cfg.mode == "BROADCASTING" else [""]
    accounts = []
    for client in clients or [""]:
        acc = GroupAccount(g if not client else f"{g}/{client}")
        for r in chains.originals:
            if not r[f"m{gi}"]:
                continue
            nxt = offsets.get(QueueKey(g, client, r["topic"], r["queue_id"]), 0)
            if r["queue_offset"] >= nxt:
                acc.counts["pending"] += 1
                continue
            state, why = _after_pass(chains.copies[g].get(r["uid"], []), g, client, offsets, promote)
            if state is None:
                acc.unaccounted.append((r["uid"], why))
            else:
                acc.counts[state] += 1
        topics = {s.topic for s in subs if s.consumer_group == g}
        acc.counts["held"] += sum(1 for r in still_held if r["real_topic"] in topics)
        accounts.append(acc)
    return accounts


def _after_pass(chain, group, client, offsets, promote) -> tuple[str | None, str]:
    """State of a message the group's offset has passed, from its copies for the group."""
    if not chain:
        return "consumed", ""
    if any(kind == "dlq" for kind, _ in chain):
        return "dead_lettered", ""
    stages = {r["k"] for _, r in chain}
    top = max(stages)
    missing = sorted(set(range(1, top)) - stages)
    if missing:
        return None, f"retry {missing[0]} missing below retry {top} of {group}"
    latest = [(kind, r) for kind, r in chain if r["k"] == top]
    shown = [r for kind, r in latest if kind == "retry"]
    if shown:
        r = shown[0]
        nxt = offsets.get((group, client, r["topic"], r["queue_id"]), 0)
        return ("consumed" if r["queue_offset"] < nxt else "retrying"), ""
    held = latest[0][1]
    if _held_passed(held, promote):
        return None, f"retry {top} of {group} promoted from {held['topic']} but not in {RETRY_PREFIX}{group}"
    return "retrying", ""
