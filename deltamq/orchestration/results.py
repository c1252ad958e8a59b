"""What a tick did: a :class:`JobRun` per step and the :class:`TickResult` of the tick
(returned by ``Broker.tick``, recorded in ``job_runs``, printed by ``deltamq tick``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltamq.clock import ms_to_iso
from deltamq.jobs.deliver_result import DeliverResult
from deltamq.jobs.sink import SinkResult


@dataclass(frozen=True, kw_only=True)
class JobRun:
    """What one job did in one tick."""

    job: str
    status: str  # OK, FAILED, SKIPPED
    rows_in: int = 0
    rows_out: int = 0
    start_ts: int = 0
    end_ts: int = 0
    error: str | None = None
    details: dict[str, int] = field(default_factory=dict)
    result: Any = None
    note: str | None = None  # why a SKIPPED job did nothing (shown, not stored)


@dataclass(frozen=True)
class TickResult:
    """What a tick did, job by job."""

    tick_id: str
    now: int
    holder: str
    jobs: tuple[JobRun, ...]
    idle: bool = False  # skipped: nothing changed since a tick that found nothing to do

    def job(self, name: str) -> JobRun:
        for j in self.jobs:
            if j.job == name:
                return j
        raise KeyError(f"job {name!r} did not run in this tick; ran {[j.job for j in self.jobs]}")

    @property
    def ok(self) -> bool:
        return all(j.status != "FAILED" for j in self.jobs)

    @property
    def delivered(self) -> DeliverResult | None:
        """What the tick's deliver passes did together (``deliver``, and ``redeliver``
        when promote's copies were due at once), or None when deliver did not run."""
        found = [
            j.result
            for j in self.jobs
            if j.job in ("deliver", "redeliver") and isinstance(j.result, DeliverResult)
        ]
        if not found:
            return None
        total = found[0]
        for more in found[1:]:
            total = total.plus(more)
        return total

    @property
    def setup_errors(self) -> tuple[tuple[str, str], ...]:
        """(group, why) of push groups whose listener, and of sinks whose transform, could
        not be loaded: they consumed nothing this tick and their messages wait (``deltamq
        tick`` exits 4)."""
        d = self.delivered
        found = list(d.setup_errors) if d is not None else []
        for j in self.jobs:
            if j.job == "sink" and isinstance(j.result, list):
                found += [
                    (r.group, r.setup_error) for r in j.result if isinstance(r, SinkResult) and r.setup_error
                ]
        return tuple(found)

    def summary(self, *, skips: bool = False) -> str:
        """One line: each job that did something (or failed) with its rows in/out, then
        each push group's counts; jobs with nothing to do are only counted (with ``skips``,
        as ``deltamq job`` prints one job's run, each is named, one skipped with the reason;
        that line then begins ``job``, not ``tick``)."""
        label = "job" if skips else "tick"
        if self.idle:
            return f"{label} {ms_to_iso(self.now)} — idle: no table changed and nothing fell due, no job ran"
        busy = [j for j in self.jobs if j.rows_in or j.rows_out or j.status == "FAILED" or j.error]
        parts = [f"{j.job}: {j.status} in={j.rows_in} out={j.rows_out}" for j in busy]
        idle = len(self.jobs) - len(busy)
        if skips:  # every job named: those skipped with the reason
            parts += [
                f"{j.job}: skipped ({j.note})"
                if j.status == "SKIPPED" and j.note
                else f"{j.job}: nothing to do"
                for j in self.jobs
                if j not in busy
            ]
            idle = 0
        if not parts:
            parts = [f"nothing to do ({idle} jobs ran)" if self.jobs else "no jobs ran"]
        elif idle:
            parts.append(f"{idle} more with nothing to do")
        return (
            f"{label} {ms_to_iso(self.now)} — "
            + "; ".join(parts)
            + "".join(f" | {g}: {text}" for g, text in self.group_lines())
        )

    def group_lines(self) -> list[tuple[str, str]]:
        """Per push group that took messages: consumed / retried / dead-lettered / filtered /
        deduplicated / suspended / dropped / not handed over, and its errors."""
        d = self.delivered
        if d is None:
            return []
        errors: dict[str, int] = {}
        for g, _, _ in d.errors:
            errors[g] = errors.get(g, 0) + 1
        out = []
        for g, c in sorted(d.by_group.items()):
            shown = [f"{_LABELS.get(k, k)} {c[k]}" for k in _GROUP_COUNTS if c.get(k)]
            if errors.get(g):
                shown.append(f"errors {errors[g]}")
            if shown:
                out.append((g, ", ".join(shown)))
        return out

    def __str__(self) -> str:
        lines = [f"tick {ms_to_iso(self.now)} ({self.tick_id}, {'ok' if self.ok else 'FAILED'})"]
        if self.idle:
            lines.append("  idle: no table changed and nothing fell due since the last tick; no job ran")
        for j in self.jobs:
            lines.append(f"  {j.job:<19} {j.status:<8} in={j.rows_in} out={j.rows_out}")
            if j.error:
                lines.append(f"    {j.error}")
        for g, text in self.group_lines():
            lines.append(f"  group {g}: {text}")
        for g, why in self.setup_errors:
            lines.append(f"  group {g} consumed nothing: {why}")
        return "\n".join(lines)


_GROUP_COUNTS = (
    "consumed",
    "retried",
    "dead_lettered",
    "filtered",
    "deduplicated",
    "later_copies",
    "suspended",
    "dropped",
    "setup_failed",
)
_LABELS = {
    "dead_lettered": "dead-lettered",
    "setup_failed": "not handed over",
    "later_copies": "later copies of a key (back after its first)",
}
