"""Rebalancing of a group's queues among its live clients (docs/behaviour.md §6): pure
functions, as RocketMQ's rebalanceByTopic with AllocateMessageQueueAveragely."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

Queue = tuple[str, int]


def allocate_averagely(queues: Sequence[Queue], clients: Sequence[str], me: str) -> list[Queue]:
    """RocketMQ's AllocateMessageQueueAveragely: both lists sorted, ``me``'s contiguous
    share (the first ``len(queues) % len(clients)`` clients get one more)."""
    mqs, cids = sorted(queues), sorted(set(clients))
    if me not in cids or not mqs:
        return []
    index, n, k = cids.index(me), len(mqs), len(cids)
    mod = n % k
    if n <= k:
        size = 1
    elif mod > 0 and index < mod:
        size = n // k + 1
    else:
        size = n // k
    start = index * size if mod > 0 and index < mod else index * size + mod
    return [mqs[(start + i) % n] for i in range(max(0, min(size, n - start)))]


def assign(queues: Sequence[Queue], clients: Sequence[str], me: str) -> list[Queue]:
    """``me``'s queues: per topic (RocketMQ's rebalanceByTopic), its averagely share."""
    by_topic: dict[str, list[Queue]] = defaultdict(list)
    for q in queues:
        by_topic[q[0]].append(q)
    return sorted(q for qs in by_topic.values() for q in allocate_averagely(qs, clients, me))


__all__ = ["Queue", "allocate_averagely", "assign"]
