"""The tick: one pass of the broker's jobs in docs/design.md's order.

``TickRunner.tick(now)`` takes the job leases (committing only when a lease is new or
past half its time, and renewing the same way before each job), refuses a ``now``
earlier than the warehouse's last tick, runs each job with ``now``, and appends one
``job_runs`` commit with a row per job. An idle tick therefore commits nothing but
that one append.

A runner whose tick found nothing to do goes *quiet* (``skip_idle_ticks``): until a
table the jobs read gets a new commit, something held falls due (``jobs/wake.py``), the
retention pass is due or a lease needs renewing, its ticks run no job and record
nothing. Whether a table changed is one look-up of its next Delta log entry, so an idle
tick on object storage costs a request per table instead of a dozen statements.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from deltamq import ids
from deltamq.clock import check_ms, ms_to_iso, to_ms
from deltamq.constants import JOB_NAMES, JOB_STEPS, MAX_ERROR_CHARS
from deltamq.errors import ClockError, LeaseHeld, LeaseLost, first_line
from deltamq.jobs import check_transactions, deliver, dispatch, promote, pull_expiry, retain, wake
from deltamq.jobs.deliver_result import DeliverResult
from deltamq.orchestration.results import JobRun, TickResult
from deltamq.schemas import TABLES
from deltamq.tables import deltalog
from deltamq.tables.integrity import diagnose, faults_named
from deltamq.tables.leases import Lease, Leases, LeaseTerms, wall_ms
from deltamq.tables.offsets import Carried

if TYPE_CHECKING:
    from deltamq.context import Context

log = logging.getLogger(__name__)


Fence = Callable[[], None]
"""Checks that the caller still holds its lease; raises LeaseLost otherwise."""


class JobFn(Protocol):
    """A step of the tick: given the runner, ``now``, the fence of its lease and the runs
    of the tick so far, its run — or None when it did not run."""

    def __call__(
        self, runner: TickRunner, now: int, fence: Fence, runs: list[JobRun], /
    ) -> JobRun | None: ...


def _dispatch(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun:
    carry = "deliver" in runner.jobs  # the hint goes with deliver's attempt record
    r = dispatch.run(runner.ctx, now, fence=fence, defer_progress=carry)
    if carry:
        runner.carried, runner.dispatched = dispatch.deferred(r), r.heads
    return JobRun(
        job="dispatch", status="OK", rows_in=r.rows_in, rows_out=r.rows_out, details=r.details, result=r
    )


def _promote(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun:
    indexes = "dispatch" in runner.jobs  # dispatch's lease is ours too: promote indexes its copies
    if indexes:
        runner.renew(["dispatch"], now)

        fence = partial(runner.fence, "promote", "dispatch")  # promote indexes its copies
    r = promote.run(
        runner.ctx, now, fence=fence, indexes=indexes, defer_progress=True, memory=runner.promote_memory
    )
    if r.progress is not None:  # committed after deliver: the copies reach their listeners first
        runner.later.append(
            ("promote", partial(promote.commit_progress, runner.ctx, r.progress, runner.promote_memory))
        )
    return JobRun(
        job="promote", status="OK", rows_in=r.rows_in, rows_out=r.rows_out, details=r.details, result=r
    )


def _redispatch(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun | None:
    """Dispatch again only if promote wrote copies it did not index itself (or found
    copies of a killed pass): a message due at ``now`` is then visible in its real topic
    in this same tick."""
    promoted = [r.result for r in runs if r.job == "promote" and r.result is not None]
    if not any(p.rows_out > p.indexed or p.already_stored for p in promoted):
        return None
    r = dispatch.run(runner.ctx, now, fence=fence)
    return JobRun(
        job="redispatch", status="OK", rows_in=r.rows_in, rows_out=r.rows_out, details=r.details, result=r
    )


def _deliver(
    runner: TickRunner,
    now: int,
    fence: Fence,
    runs: list[JobRun],
    job: str = "deliver",
    only: frozenset[tuple[str, int]] | None = None,
) -> JobRun:
    carried, heads = (runner.carried, runner.dispatched) if job == "deliver" else (None, None)
    runner.carried = runner.dispatched = None
    if carried is not None:
        runner.renew(["dispatch"], now)
        own, pending = fence, carried

        def fence() -> None:  # dispatch's lease too, until its hint is written
            own()
            if not pending.written:
                runner.fence("dispatch")

    try:
        memory = runner.deliver_memory
        r = deliver.run(runner.ctx, now, fence=fence, memory=memory, only=only, carried=carried, heads=heads)
    except Exception:
        if carried is not None and not carried.written:
            runner.write_carried(carried, now, failing=True)
        raise
    if carried is not None and not carried.written:  # the pass took nothing
        runner.write_carried(carried, now)
    return JobRun(
        job=job,
        status="OK",
        rows_in=r.taken,
        rows_out=r.consumed + r.retried + r.dead_lettered,
        error=_listener_errors(r),
        details=r.details,
        result=r,
    )


def _redeliver(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun | None:
    """Deliver again only if promote's pass found entries already due at ``now`` (a due
    time it did not see coming: the first tick after a pause, a message sent late, a
    fake clock's jump): their copies reach their listeners in this same tick, from the
    queues they went to. Copies promoted ahead wait for the next tick's deliver, which
    runs first."""
    promoted = [r.result for r in runs if r.job == "promote" and isinstance(r.result, promote.PromoteResult)]
    due = [p for p in promoted if p.due_now]
    if not due:
        return None
    queues = [p.due_queues for p in due]
    only = (
        None if any(q is None for q in queues) else frozenset().union(*(q for q in queues if q is not None))
    )
    return _deliver(runner, now, fence, runs, job="redeliver", only=only)


def _listener_errors(r: DeliverResult) -> str | None:
    """The deliver row's ``error`` in ``job_runs``: per group whose listener failed, how
    many failures and the first error (a listener that cannot be loaded first)."""
    first: dict[str, str] = dict(r.setup_errors)
    n: dict[str, int] = {g: r.by_group.get(g, {}).get("setup_failed", 0) for g in first}
    for g, _, error in r.errors:
        first.setdefault(g, error)
        n[g] = n.get(g, 0) + 1
    if not first:
        return None
    text = "; ".join(f"group {g}: {n[g]} failed, first: {first[g]}" for g in sorted(first))
    return text[:MAX_ERROR_CHARS]


def _pull_expiry(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun:
    """Pull deliveries not acked within their invisible time: RECONSUME_LATER."""
    r = pull_expiry.expire(runner.ctx, now, fence=fence)
    gone = (
        f"{r.gone} pulled messages expired or were nacked after retention removed them: no retry "
        "carries them (raise the topic's retention above the pull clients' longest hold)"
        if r.gone
        else None
    )
    return JobRun(
        job="pull_expiry",
        status="OK",
        rows_in=r.expired,
        rows_out=r.expired,
        error=gone,
        details={"expired": r.expired, "gone": r.gone},
    )


def _sink(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun | None:
    """Exactly-once Delta sinks: each sink group's new messages MERGEd into its table."""
    from deltamq.jobs import sink

    delivered = next((r.result for r in runs if r.job == "deliver"), None)
    if delivered is not None and not delivered.sinks:
        return None  # deliver read group_config this tick: no sink groups
    results = sink.run(runner.ctx, now, fence=fence)
    if not results:
        return None
    n = sum(r.messages for r in results)
    unloaded = [f"sink {r.group!r}: {r.setup_error}" for r in results if r.setup_error]
    return JobRun(
        job="sink",
        status="OK",
        rows_in=n,
        rows_out=n,
        error="; ".join(unloaded) or None,
        details={"sinks": len(results), "merged": n},
        result=results,
    )


def _check_transactions(
    runner: TickRunner, now: int, fence: Callable[[], None], runs: list[JobRun]
) -> JobRun:
    r = check_transactions.run(runner.ctx, now, fence=fence)
    return JobRun(
        job="check_transactions",
        status="OK" if r.ran else "SKIPPED",
        rows_in=r.rows_in,
        rows_out=r.written,
        error=r.error[:MAX_ERROR_CHARS] if r.error else None,
        details=r.details,
        result=r,
        note=None if r.ran else _CHECK_SKIPS.get(r.skipped or "", r.skipped),
    )


def _retain(runner: TickRunner, now: int, fence: Fence, runs: list[JobRun]) -> JobRun:
    r = retain.run(runner.ctx, now, fence=fence, memory=runner.retain_memory)
    return JobRun(
        job="retain",
        status="OK" if r.ran else "SKIPPED",
        rows_in=r.index_rows + r.timer_rows,
        rows_out=r.body_rows,
        details=r.details,
        result=r,
        note=None if r.ran else "not due: a retention pass runs every retain_interval_ms",
    )


_CHECK_SKIPS = {
    "interval": "not due: a check pass runs every transaction_check_interval_ms",
    "idle": "no half message to check",
    "dispatch_behind": "waiting for dispatch to index the last pass's copies",
}
_NOTHING_TO_DO = {
    "redispatch": "promote wrote nothing it did not index: nothing to dispatch again",
    "redeliver": "promote found nothing due already: nothing to deliver again",
    "sink": "no group is a sink (Broker.sink_to_table)",
}

STEPS: dict[str, JobFn] = {
    "dispatch": _dispatch,
    "promote": _promote,
    "redispatch": _redispatch,
    "deliver": _deliver,
    "redeliver": _redeliver,
    "pull_expiry": _pull_expiry,
    "sink": _sink,
    "check_transactions": _check_transactions,
    "retain": _retain,
}

# (step, lease kind, function), in the order of deltamq.constants.JOB_STEPS
SEQUENCE: tuple[tuple[str, str, JobFn], ...] = tuple((step, lease, STEPS[step]) for step, lease in JOB_STEPS)


_JOB_RUNS_ARROW = pa.schema(
    [
        ("tick_id", pa.string()),
        ("now_ts", pa.int64()),
        ("job", pa.string()),
        ("start_ts", pa.int64()),
        ("end_ts", pa.int64()),
        ("rows_in", pa.int64()),
        ("rows_out", pa.int64()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("holder", pa.string()),
        ("run_date", pa.date32()),
        ("details", pa.map_(pa.string(), pa.int64())),
    ]
)

# the tables whose new commits may give a tick work: all but the runners' own records
WATCHED = tuple(t for t in TABLES if t not in ("job_runs", "leases", "dq_results"))


@dataclass(frozen=True)
class Quiet:
    """A runner's reason to skip its next ticks' jobs: the last tick found nothing to do
    with the watched tables at ``versions`` (under ``ctx``: a new configuration ends it),
    and nothing held falls due before ``until`` (tick clock; None: nothing is held)."""

    ctx: Context
    versions: dict[str, int]
    until: int | None


def job_sequence(job: str) -> tuple[tuple[str, str, JobFn], ...]:
    """The sequence that runs one job kind on its own (e.g. ``deltamq job promote``): every
    step under that job's lease (``deliver`` includes the pull deliveries' expiry)."""
    if job not in JOB_NAMES:
        raise ValueError(f"unknown job {job!r}; jobs are {JOB_NAMES}")
    return tuple(s for s in SEQUENCE if s[1] == job)


class TickRunner:
    """Runs ticks on one warehouse (its :class:`Context`), holding the job leases between
    ticks and what the jobs remember from one tick to the next (retain's last pass, the
    size of the messages deliver handed over, promote's state)."""

    def __init__(
        self,
        ctx: Context,
        holder: str | None = None,
        sequence: tuple[tuple[str, str, JobFn], ...] = SEQUENCE,
    ) -> None:
        self.ctx = ctx
        self.retain_memory = retain.Memory()
        self.promote_memory = promote.Memory()
        self.deliver_memory = deliver.Memory()
        self.sequence = sequence
        self.jobs = tuple(dict.fromkeys(lease for _, lease, _ in sequence))
        self.leases = Leases(ctx.warehouse, holder)
        self.later: list[tuple[str, Callable[[], None]]] = []  # (step, commit) for the tick's end
        self.carried: Carried | None = None  # dispatch's hint, for deliver's attempt record
        self.dispatched: dict[tuple[str, int], int] | None = None  # the index heads after dispatch
        self.last_now: int | None = None
        self._epochs: dict[str, int] = {}  # the epoch of each lease at the last tick
        self._stop = threading.Event()
        self._versions: dict[str, int] = {}  # the watched tables' versions, as last seen
        self.quiet: Quiet | None = None
        self._looked: dict[str, int] | None = None  # versions the quiet check found moved

    @property
    def holder(self) -> str:
        return self.leases.holder

    @property
    def terms(self) -> LeaseTerms:
        """Lease terms from the runner's context as it is now (Broker.reconfigure replaces it)."""
        return LeaseTerms.of(self.ctx.config)

    def _load_last_now(self, lease_last_now: int | None) -> int | None:
        wh = self.ctx.warehouse
        where = ""
        if lease_last_now is not None:
            where = f" WHERE run_date >= date_from_unix_date({lease_last_now // ids.DAY_MS})"
        row = self.ctx.engine.rows(f"SELECT max(now_ts) AS m FROM {wh.ref('job_runs')}{where}")[0]
        candidates = [x for x in (row["m"], lease_last_now) if x is not None]
        return max(candidates) if candidates else None

    def _take_leases(self, now_ms: int) -> None:
        """The tick's leases, and the warehouse's last ``now`` at the first tick and
        whenever a lease changed hands since this runner's last tick."""
        held = self.leases.acquire(self.jobs, self.terms, last_now=now_ms)
        moved = any(self._epochs.get(job) != lease.epoch for job, lease in held.items())
        self._forget_if_fenced(held)
        if self.last_now is None or moved:  # first tick, or another runner may have ticked since
            self._catch_up(held)

    def _catch_up(self, held: dict[str, Lease]) -> None:
        """Keep the warehouse's last ``now`` (the lease rows' and ``job_runs``') as this
        runner's, when it is later: another runner may have ticked since this one did."""
        nows = [lease.last_now for lease in held.values() if lease.last_now is not None]
        loaded = self._load_last_now(max(nows, default=None))
        self.last_now = max((x for x in (loaded, self.last_now) if x is not None), default=None)

    def tick(self, now: int | datetime | None = None) -> TickResult:
        """Run one tick at ``now`` (default: the broker's clock)."""
        now_ms = self.ctx.clock.now_ms() if now is None else check_ms(to_ms(now))
        skipped = self._skip_if_quiet(now_ms, now is None)
        if skipped is not None:
            return skipped
        self.ctx.engine.recycle_if_large(self.ctx.config.embedded_max_rss_mb)
        with faults_named(self.ctx.warehouse):
            self._take_leases(now_ms)
            # the versions the quiet check just looked up (the lease rows are not watched),
            # else a look now
            seen, self._looked = self._looked, None
            if seen is None and self.ctx.config.skip_idle_ticks and len(self.jobs) > 1:
                seen = self._watch()
        held = self._held_now(now_ms, now is None)
        if held != now_ms:
            log.warning(
                "clock %s ms behind the warehouse's last tick: ticking at its now %s",
                held - now_ms,
                ms_to_iso(held),
            )
            now_ms = held
        if self.last_now is not None and now_ms < self.last_now:
            raise ClockError(
                f"now={now_ms} ({ms_to_iso(now_ms)}) is earlier than the warehouse's last tick "
                f"{self.last_now} ({ms_to_iso(self.last_now)}); a tick's now never goes back"
            )
        tick_id = self._tick_id(now_ms)
        runs: list[JobRun] = []
        failed: BaseException | None = None
        self.later = []
        self.carried = self.dispatched = None
        for name, lease, fn in self.sequence:
            start = wall_ms()
            if failed is not None:
                runs.append(JobRun(job=name, status="SKIPPED", start_ts=start, end_ts=start))
                continue
            if self._stop.is_set():  # SIGTERM/SIGINT: stop between jobs
                runs.append(
                    JobRun(job=name, status="SKIPPED", start_ts=start, end_ts=start, error="stopping")
                )
                continue
            try:
                self.renew([lease], now_ms)
                run = fn(self, now_ms, partial(self.fence, lease), runs)
                if run is None and len(self.jobs) == 1:
                    # one job kind on its own (`deltamq job`, an Airflow task): a step that
                    # had nothing to do is recorded too, so every run says what it did
                    run = JobRun(job=name, status="SKIPPED", note=_NOTHING_TO_DO.get(name))
                if run is not None:
                    runs.append(_stamped(run, start))
            except Exception as raised:  # noqa: BLE001 - recorded, then re-raised after the append
                failed = e = diagnose(self.ctx.warehouse, raised)
                runs.append(
                    JobRun(
                        job=name,
                        status="FAILED",
                        start_ts=start,
                        end_ts=wall_ms(),
                        error="".join(traceback.format_exception_only(type(e), e)).strip(),
                    )
                )
        if failed is None:
            failed = self._run_later(runs)
        self.last_now = max(now_ms, self.last_now or now_ms)  # a later now seen mid-tick stays
        result = TickResult(tick_id, now_ms, self.holder, tuple(runs))
        self._record(result)
        if failed is not None:
            raise failed
        self.quiet = self._quiet_after(result, seen)
        return result

    # --- idle ticks -----------------------------------------------------------------------
    def _watch(self) -> dict[str, int]:
        """The watched tables' versions now (a look-up per table, one more per new commit)."""
        wh = self.ctx.warehouse
        # the walk to each table's head starts from the newest version this process knows
        # of: what its jobs read and wrote since the last look costs no look-up of its own
        if self._versions:
            known = wh.known_versions()
            self._versions = {t: max(v, known.get(t, -1)) for t, v in self._versions.items()}
        self._versions = deltalog.latest_versions(wh.storage, {t: wh.uri(t) for t in WATCHED}, self._versions)
        return dict(self._versions)

    def _quiet_after(self, result: TickResult, seen: dict[str, int] | None) -> Quiet | None:
        """Quiet after ``result`` when it did nothing, wrote nothing the jobs read (the
        versions are those ``seen`` at its start) and reported no error."""
        if seen is None or not result.ok or result.setup_errors:
            return None
        if any(j.rows_in or j.rows_out or j.error for j in result.jobs):
            return None
        with faults_named(self.ctx.warehouse):
            if self._watch() != seen:
                return None  # written meanwhile (by this tick, or by another writer)
            due = wake.next_due(self.ctx, result.now, state=self.promote_memory.state)
            return Quiet(self.ctx, seen, due)

    def _skip_if_quiet(self, now_ms: int, own_clock: bool) -> TickResult | None:
        """An idle tick's result when the runner is quiet and still may be; None to run
        the jobs. A tick never goes back in time, idle or not."""
        quiet = self.quiet
        if quiet is None:
            return None
        now_ms = self._held_now(now_ms, own_clock)
        last_pass = self.retain_memory.last_pass
        due = [
            quiet.until,
            None if last_pass is None else last_pass + self.ctx.config.retain_interval_ms,
        ]
        if (
            quiet.ctx is not self.ctx
            or (self.last_now is not None and now_ms < self.last_now)
            or any(d is not None and now_ms >= d for d in due)
            or last_pass is None
            or self.leases.renewal_due(self.jobs, self.terms)
        ):
            self.quiet = None
            return None
        with faults_named(self.ctx.warehouse):
            looked = self._watch()
            if looked != quiet.versions:
                self.quiet = None
                self._looked = looked  # the tick's own look at its start
                return None
        self.last_now = now_ms
        return TickResult(self._tick_id(now_ms), now_ms, self.holder, (), idle=True)

    def _tick_id(self, now_ms: int) -> str:
        return f"{now_ms:013d}-{self.holder.rsplit(':', 1)[-1]}"

    def _held_now(self, now_ms: int, own_clock: bool) -> int:
        """``now_ms``, or the last tick's now when this runner's own clock is behind it by
        less than the lease TTL (the skew leases allow): a tick holds time there."""
        if self.last_now is not None and own_clock and 0 < self.last_now - now_ms <= self.terms.ttl_ms:
            return self.last_now
        return now_ms

    def write_carried(self, carried: Carried, now_ms: int, *, failing: bool = False) -> None:
        """Dispatch's hint on its own, when deliver's attempt record did not carry it (the
        pass took nothing, or failed before). ``failing``: deliver is raising; a failure
        here is logged and deliver's error is the one raised. Unwritten, the hint only
        lags: readers correct it from the index rows newer than it."""
        try:
            self.leases.check(["dispatch"])
            dispatch.write_deferred(self.ctx, carried, now_ms)
        except Exception:
            if not failing:
                raise
            log.warning("dispatch's progress was not recorded in this tick", exc_info=True)

    def fence(self, *jobs: str) -> None:
        """Before a step's commit: the leases of ``jobs`` renewed when half their time is
        gone (a pass longer than a lease keeps it while nobody else took it), then checked
        in one read (LeaseLost when another runner holds one, or took it at a new epoch
        meanwhile)."""
        before = {job: self.leases.held.get(job) for job in jobs}
        self.leases.renew_due(list(jobs), self.terms)
        for job, was in before.items():
            after = self.leases.held.get(job)
            if was is None or after is None or after.epoch == was.epoch:
                continue
            # lapsed, and taken again: at the next epoch when the row was still ours at
            # ours (every other taker raises the epoch), further on when another runner
            # held it in between and may have run the job
            if after.epoch != was.epoch + 1:
                raise LeaseLost(
                    f"lease of job {job!r} lapsed during its step and another runner held it "
                    f"meanwhile (epoch {was.epoch} → {after.epoch}); this runner stops writing"
                )
            if self._epochs.get(job) == was.epoch:
                self._epochs[job] = after.epoch
        self.leases.check(list(jobs))

    def renew(self, jobs: Sequence[str], now_ms: int) -> None:
        """Renew ``jobs`` before a step (:meth:`Leases.renew_due`). A lease that lapsed
        during the tick and was taken again at a new epoch means another runner may have
        run that job in between: what the jobs remember is dropped, as at a tick's start,
        and if that runner ticked at a later ``now`` than this tick's, the tick stops
        (time never goes back: docs/reliability.md, "Skewed clocks")."""
        self.leases.renew_due(jobs, self.terms)
        held = {job: self.leases.held[job] for job in self.jobs if job in self.leases.held}
        if all(self._epochs.get(job) == lease.epoch for job, lease in held.items()):
            return
        self._forget_if_fenced(held)
        self._catch_up(held)
        later = self.last_now or 0
        if later > now_ms:
            raise LeaseLost(
                f"a lease lapsed during this tick at now={now_ms} ({ms_to_iso(now_ms)}), and another "
                f"runner ticked at {later} ({ms_to_iso(later)}) before it was taken again; this "
                "tick stops, the next starts from the tables"
            )

    def _forget_if_fenced(self, held: dict[str, Lease]) -> None:
        """A lease taken at a new epoch means another runner may have run that job since
        this one last did (or this one's lease lapsed): what the job remembered is dropped
        and read again from the tables (promote's positions could otherwise stay behind
        entries retention has since deleted)."""
        epochs = {job: lease.epoch for job, lease in held.items()}
        if "promote" in epochs and self._epochs.get("promote") != epochs["promote"]:
            self.promote_memory = promote.Memory()
        self._epochs = epochs

    def _run_later(self, runs: list[JobRun]) -> BaseException | None:
        """Run the commits steps left for after the others (``self.later``: promote's
        progress, once its copies are indexed, so deliver hands them over sooner); their
        time goes in the step's ``details`` (``later_ms``), a failure in a FAILED row."""
        for name, commit in self.later:
            start = wall_ms()
            try:
                commit()
            except Exception as raised:  # noqa: BLE001 - recorded, then re-raised by tick()
                e = diagnose(self.ctx.warehouse, raised)
                error = "".join(traceback.format_exception_only(type(e), e)).strip()
                runs.append(JobRun(job=name, status="FAILED", start_ts=start, end_ts=wall_ms(), error=error))
                return e
            for i, run in enumerate(runs):
                if run.job == name:
                    runs[i] = replace(run, details={**run.details, "later_ms": wall_ms() - start})
        return None

    def _record(self, result: TickResult) -> None:
        """One append of the tick's ``job_runs`` rows (written without an engine round
        trip: Warehouse.append_arrow)."""
        day = ids.store_date(result.now)
        columns: dict[str, list[Any]] = {name: [] for name in _JOB_RUNS_ARROW.names}
        for j in result.jobs:
            values = (
                result.tick_id,
                result.now,
                j.job,
                j.start_ts,
                j.end_ts,
                j.rows_in,
                j.rows_out,
                j.status,
                j.error,
                result.holder,
                day,
                [(k, int(v)) for k, v in j.details.items()],
            )
            for name, value in zip(_JOB_RUNS_ARROW.names, values, strict=True):
                columns[name].append(value)
        rows = pa.table(columns, schema=_JOB_RUNS_ARROW)
        self.ctx.commit(lambda: self.ctx.warehouse.append_arrow("job_runs", rows), what="job_runs")

    def release(self) -> None:
        self.leases.release(self.ctx.config.commit_policy)

    # --- loop ---------------------------------------------------------------------------------
    def stop(self, *_: object) -> None:
        self._stop.set()

    def loop(
        self,
        interval_s: float,
        for_s: float | None = None,
        on_tick: Callable[[TickResult], None] | None = None,
        on_wait: Callable[[LeaseHeld], None] | None = None,
        wake_at_due: bool = True,
        on_error: Callable[[Exception], None] | None = None,
    ) -> int:
        """Tick every ``interval_s`` until stopped or ``for_s`` elapsed (on the runner's
        clock: a FakeClock's ``sleep`` moves it, so tests run hours in milliseconds).

        With ``wake_at_due`` the loop does not sleep past the next due time of anything
        held (``jobs/wake.py``): a delayed or timer message, a retry, a suspended orderly
        queue, a pull delivery's invisible time or the next transaction check is handled
        when it falls due, not up to an interval later. SIGTERM/SIGINT stop the loop
        between jobs (the tick in progress records the rest as SKIPPED). While another
        runner holds a lease the loop waits, saying so each interval (``on_wait``). A
        failed tick (recorded in ``job_runs``) is passed to ``on_error``, or logged in one
        line, and the loop goes on. Returns the number of ticks run (a wait is none).
        """
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self.stop) for sig in handled}
        try:
            return self._loop(interval_s, for_s, on_tick, on_wait, on_error, wake_at_due)
        finally:  # the process's own handlers again (a loop in a larger program, a test)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop.clear()  # a stop ends this loop: later ticks and loops run

    def _loop(
        self,
        interval_s: float,
        for_s: float | None,
        on_tick: Callable[[TickResult], None] | None,
        on_wait: Callable[[LeaseHeld], None] | None,
        on_error: Callable[[Exception], None] | None,
        wake_at_due: bool,
    ) -> int:
        clock = self.ctx.clock
        virtual = getattr(clock, "sleep", None) is not None  # a FakeClock: its own time throughout

        def seconds() -> float:  # the loop's time: the wall's, or a fake clock's
            return clock.now_ms() / 1000.0 if virtual else time.monotonic()

        deadline = None if for_s is None else seconds() + for_s
        n = 0
        previous: int | None = None  # the last tick's now
        while not self._stop.is_set():
            started = seconds()
            ran = True
            due: int | None = None
            try:
                result = self.tick()
                if on_tick:
                    on_tick(result)
                if wake_at_due:
                    ended = clock.now_ms()
                    if not virtual and _due_meanwhile(result, previous, ended):
                        due = ended  # more fell due while this tick ran: tick again now
                    elif self.quiet is not None:
                        due = self.quiet.until  # read when the runner went quiet
                    else:
                        due = wake.next_due(self.ctx, result.now)
                previous = result.now
            except LeaseHeld as e:  # another runner ticks: wait for its lease to end
                if on_wait:
                    on_wait(e)  # the caller says it (once), or it is logged
                else:
                    log.warning("waiting: %s", e)
                ran = False
            except Exception as e:  # noqa: BLE001 - a loop survives one failed tick; it was recorded
                if on_error:
                    on_error(e)
                else:  # one line where the user looks; the traceback for debugging
                    log.error("tick failed: %s", first_line(e))
                log.debug("tick failed", exc_info=True)
            n += ran
            now = seconds()
            if deadline is not None and now >= deadline:
                break
            wait = interval_s - (now - started)
            if due is not None:  # the due time is on the clock: wait until then
                wait = min(wait, (due - clock.now_ms()) / 1000.0)
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._sleep(max(0.0, wait))
        return n

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the runner's clock: a clock with ``sleep`` (FakeClock) is
        moved; the wall clock is waited on, and a stop ends the wait."""
        sleep = getattr(self.ctx.clock, "sleep", None)
        if sleep is not None:
            sleep(seconds)
        elif seconds > 0:
            self._stop.wait(seconds)


def _due_meanwhile(result: TickResult, previous: int | None, ended: int) -> bool:
    """Whether held work most likely fell due while ``result``'s tick ran: its promote pass
    handled entries at a rate (per ms since the previous tick's now) that puts at least one
    in the time the tick took. The loop then ticks again at once, without reading the next
    due time (a statement or three), as a loop with work falling due all the time would."""
    handled = sum(j.rows_in for j in result.jobs if j.job == "promote")
    if not handled or previous is None or result.now <= previous or ended <= result.now:
        return False
    return handled * (ended - result.now) >= result.now - previous


def _stamped(run: JobRun, start: int) -> JobRun:
    return JobRun(
        job=run.job,
        status=run.status,
        rows_in=run.rows_in,
        rows_out=run.rows_out,
        start_ts=start,
        end_ts=wall_ms(),
        error=run.error,
        details=run.details,
        result=run.result,
        note=run.note,
    )


__all__ = ["JOB_NAMES", "JobRun", "SEQUENCE", "TickResult", "TickRunner", "job_sequence"]
