"""What each push group takes in a deliver pass, planned from the queue heads and the
groups' offsets (pure: no reads, no writes); deltamq/jobs/deliver.py runs the pass."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from deltamq.filters import parse_tag_expression
from deltamq.tables.offsets import START, Position, QueueKey

if TYPE_CHECKING:
    from deltamq.config import GroupConfig, Subscription

K = TypeVar("K", bound=Hashable)

POISON_TRIES = 3
"""Attempts without an outcome after which a queue's head is taken alone, to be
dead-lettered."""
AUTO_FIRST_TAKE = 10_000
"""Messages per queue an automatic take (``pull_batch_size`` 0) gets while the size of a
message is not known yet: the first pass of a process with no deliver on record."""


@dataclass(frozen=True)
class QueueTake:
    group: str
    topic: str
    queue_id: int
    lo: int
    hi: int  # exclusive
    tags: tuple[str, ...] | None
    attempts: int
    attempt_ts: int
    sql92: str | None = None
    client: str = ""  # BROADCASTING: the instance; CLUSTERING: ''
    suspends: int = 0  # orderly: times the head message was suspended
    poison: bool = False  # the head's attempts kept ending without an outcome: taken alone


def plan_takes(
    groups: dict[str, GroupConfig],
    subscriptions: list[Subscription],
    heads: dict[tuple[str, int], int],
    offsets: Mapping[QueueKey, Position],
    now: int,
    poison_tries: int = POISON_TRIES,
    auto_budget: int | None = None,
    excused: Mapping[QueueKey, int] | None = None,
) -> list[QueueTake]:
    """Pure: which offsets of which queues each group takes in this pass. A group with a
    ``pull_batch_size`` takes at most that many per queue; the others (0, the default)
    share ``auto_budget`` messages between their queues (:func:`size_takes`), or take
    :data:`AUTO_FIRST_TAKE` per queue when it is None. ``excused``: per queue, attempts at
    its offset that this process saw fail with an error of its own (a store that failed,
    say), not end without a word: they do not count towards ``poison_tries``."""
    takes: list[QueueTake] = []
    backlogs: list[int] = []
    auto: list[int] = []
    for sub in subscriptions:
        g = groups.get(sub.consumer_group)
        if g is None:
            continue
        tags = parse_tag_expression(sub.expression) if sub.expr_type == "TAG" else None
        clients = [""] if g.mode == "CLUSTERING" else list(g.instances or [])
        for client, ((topic, qid), head) in ((c, h) for c in clients for h in sorted(heads.items())):
            if topic != sub.topic:
                continue
            at = offsets.get(QueueKey(g.consumer_group, client, topic, qid), START)
            nxt, attempts, attempt_ts = at.next_offset, at.attempts, at.attempt_ts
            suspends, suspend_until = at.suspends, at.suspend_until
            if nxt >= head:
                continue
            if g.orderly and suspend_until is not None and suspend_until > now:
                continue  # orderly: the queue waits behind its suspended message
            # After a lost attempt the range is taken again from the same offset with the
            # same attempt time, so its sends-back get the same ids (already-stored ones are
            # skipped). Only a head that keeps ending attempts without an outcome is taken
            # alone, to be dead-lettered.
            key = QueueKey(g.consumer_group, client, topic, qid)
            poison = attempts - (excused or {}).get(key, 0) >= poison_tries
            if poison:
                size = 1
            elif g.pull_batch_size:
                size = g.pull_batch_size
            else:
                size = AUTO_FIRST_TAKE
                auto.append(len(takes))
            backlogs.append(head - nxt)
            takes.append(
                QueueTake(
                    g.consumer_group,
                    topic,
                    qid,
                    nxt,
                    min(head, nxt + size),
                    tuple(tags) if tags is not None else None,
                    attempts,
                    attempt_ts if attempts and attempt_ts is not None else now,
                    sub.expression if sub.expr_type == "SQL92" else None,
                    client,
                    suspends if g.orderly else 0,
                    poison,
                )
            )
    if auto_budget is not None and auto:
        for i, size in zip(auto, size_takes([backlogs[i] for i in auto], auto_budget), strict=True):
            takes[i] = replace(takes[i], hi=takes[i].lo + size)
    return takes


def size_takes(backlogs: list[int], budget: int) -> list[int]:
    """Pure: how many of each queue's ``backlogs`` to take so that together they stay
    within ``budget`` messages, as evenly as the backlogs allow (a queue with less than
    its share takes all of it and leaves the rest to the others); at least one each."""
    sizes = [0] * len(backlogs)
    left = budget
    order = sorted(range(len(backlogs)), key=lambda i: backlogs[i])
    for k, i in enumerate(order):
        share = left // (len(order) - k)
        sizes[i] = max(1, min(backlogs[i], share))
        left = max(0, left - sizes[i])
    return sizes


def held_from(deferred: Mapping[K, Collection[int]], seen: Mapping[K, Iterable[int]]) -> dict[K, int]:
    """Pure: per queue with ``deferred`` offsets (not handed over: a listener timed out),
    the offset it holds from — the lowest deferred offset above every other offset the
    pass handled there (``seen``: every offset it matched, deferred ones included). A
    queue whose deferred offsets all lie below a handled one is absent: holding there
    would hand the handled ones out again, so those go the send-back way instead."""
    out: dict[K, int] = {}
    for q, d in deferred.items():
        top = max((x for x in seen.get(q, ()) if x not in d), default=-1)
        above = [x for x in d if x > top]
        if above:
            out[q] = min(above)
    return out
