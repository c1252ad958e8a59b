"""What a deliver pass did (:class:`DeliverResult`): the counts of the tick's ``deliver``
(and ``redeliver``) step, per outcome and per group, as ``deltamq.jobs.deliver`` returns
them and the tick runner records them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

BACKLOG_KEY = "backlog."
"""``job_runs.details`` of a deliver row: ``backlog.<group>`` = that push group's lag when
the pass began (``backlog`` is their total)."""


@dataclass(frozen=True, kw_only=True)
class DeliverResult:
    taken: int = 0
    # messages the listeners dealt with: taken less filtered, duplicate, poison, what a
    # timed-out listener left for the next pass, and what a listener that cannot be
    # loaded could not take (setup_failed)
    handed_over: int = 0
    body_bytes: int = 0  # their bodies' bytes (sizes the automatic takes: Memory)
    consumed: int = 0
    filtered: int = 0
    retried: int = 0
    dead_lettered: int = 0
    poison: int = 0
    dropped: int = 0  # BROADCASTING failures: logged and dropped
    suspended: int = 0  # orderly: messages of suspended chunks (their queue waits)
    deduplicated: int = 0  # key already consumed within the window: acknowledged unseen
    later_copies: int = 0  # a key's later copies in one pass: sent back to wait for the first's outcome
    setup_failed: int = 0  # not handed over: the group's listener could not be loaded (they wait)
    backlog: int = 0  # messages behind the push groups' offsets when the pass began (their lag)
    backlog_by_group: dict[str, int] = field(default_factory=dict)  # the same, per push group
    groups: int = 0
    errors: tuple[tuple[str, str, str], ...] = ()  # (group, msg id, error text), a sample
    setup_errors: tuple[tuple[str, str], ...] = ()  # (group, error) of groups whose listener cannot load
    skipped_groups: tuple[str, ...] = ()
    by_group: dict[str, dict[str, int]] = field(default_factory=dict)
    sinks: tuple[str, ...] = ()  # groups that are exact-once sinks (the tick's sink step runs them)

    def plus(self, other: DeliverResult) -> DeliverResult:
        """Two passes of one tick as one: counts added; the backlog, groups, skipped
        groups and sinks as the first pass found them."""
        counts = {
            name: getattr(self, name) + getattr(other, name)
            for name in (
                "taken",
                "handed_over",
                "body_bytes",
                "consumed",
                "filtered",
                "retried",
                "dead_lettered",
                "poison",
                "dropped",
                "suspended",
                "deduplicated",
                "later_copies",
                "setup_failed",
            )
        }
        by_group = {g: dict(c) for g, c in self.by_group.items()}
        for g, c in other.by_group.items():
            mine = by_group.setdefault(g, {})
            for k, n in c.items():
                mine[k] = mine.get(k, 0) + n
        return replace(
            self,
            **counts,
            errors=self.errors + other.errors,
            setup_errors=tuple(dict.fromkeys(self.setup_errors + other.setup_errors)),
            by_group=by_group,
        )

    @property
    def details(self) -> dict[str, int]:
        return {
            "taken": self.taken,
            "handed_over": self.handed_over,
            "body_bytes": self.body_bytes,
            "consumed": self.consumed,
            "filtered": self.filtered,
            "retried": self.retried,
            "dead_lettered": self.dead_lettered,
            "poison": self.poison,
            "dropped": self.dropped,
            "suspended": self.suspended,
            "deduplicated": self.deduplicated,
            "later_copies": self.later_copies,
            "setup_failed": self.setup_failed,
            "listener_errors": len(self.errors),
            "backlog": self.backlog,
            "groups": self.groups,
            "groups_without_listener": len(self.skipped_groups),
        } | {f"{BACKLOG_KEY}{g}": n for g, n in self.backlog_by_group.items()}


# --- reading ------------------------------------------------------------------------------
