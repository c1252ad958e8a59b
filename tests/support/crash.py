"""Crash harness: run a named job in a subprocess and SIGKILL it at a chosen point.

Points are injected by ``deltamq.faults`` (``DELTAMQ_CRASH_AT=<point>[:<n>]``): the
child kills itself exactly there, before or after a commit. Random kills wait for the
child's ``READY`` line (printed once the broker is open, right before the job runs)
and then kill it after a random delay. Every later job issue reuses this module.

A crash test's set-up is a :class:`CrashRounds` (warehouse, :class:`KillPlan`, seeded
random generator); :func:`crash_at` stops code running in this process at a point.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RUNNER_ID = "crash-harness-runner"


@dataclass(frozen=True)
class JobOutcome:
    returncode: int
    killed: bool
    stdout: str
    stderr: str


def run_job(
    warehouse: str | Path,
    job: str,
    now: int,
    *,
    crash_at: str | None = None,
    kill_after_s: float | None = None,
    timeout_s: float = 180,
    env: dict[str, str] | None = None,
) -> JobOutcome:
    """Run ``deltamq job <job>`` (or ``deltamq tick`` for job "tick") in a subprocess;
    optionally kill it at a crash point or after a random time."""
    extra = env or {}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    env.update(extra)
    env["RUST_LOG"] = "error"
    env["DELTAMQ_READY_LINE"] = "1"  # the child prints READY right before its job runs
    env["DELTAMQ_RUNNER_ID"] = RUNNER_ID  # a restarted runner keeps its lease
    env.pop("DELTAMQ_CRASH_AT", None)
    if crash_at:
        env["DELTAMQ_CRASH_AT"] = crash_at
    verb = ["tick"] if job == "tick" else ["job", job]
    cmd = [sys.executable, "-m", "deltamq.cli", *verb, "--warehouse", str(warehouse), "--now", str(now)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed_by_us = False
    if kill_after_s is not None:
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.strip() == "READY":
                break
        if line.strip() == "READY":
            time.sleep(kill_after_s)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed_by_us = True
    out, err = proc.communicate(timeout=timeout_s)
    # (a job may finish between our poll and the signal: then it was not killed)
    killed = proc.returncode == -signal.SIGKILL
    assert killed or proc.returncode == 0 or not killed_by_us, err[-2000:]
    return JobOutcome(proc.returncode, killed, out, err)


def random_delay(rng: random.Random, low: float = 0.0, high: float = 0.25) -> float:
    return rng.uniform(low, high)


class KillPlan:
    """Rounds of a crash test: every crash point ``each`` times, then random-time kills —
    at least ``random_rounds`` of them, and more (up to ``most_random``) until ``want``
    kills have really happened (a random kill can miss a job that finished first)."""

    def __init__(
        self,
        points: list[str],
        *,
        each: int = 2,
        random_rounds: int = 4,
        want: int = 10,
        most_random: int = 24,
    ) -> None:
        self.points, self.each = points, each
        self.random_rounds, self.want, self.most_random = random_rounds, want, most_random
        self.kills = 0

    def __iter__(self):
        for point in self.points:
            for _ in range(self.each):
                yield point, None
        n = 0
        while n < self.most_random and (n < self.random_rounds or self.kills < self.want):
            n += 1
            yield None, "random"

    def record(self, killed: bool) -> None:
        self.kills += bool(killed)


def kill_and_rerun(
    plan: KillPlan,
    warehouse: str | Path,
    job: str,
    now: int,
    point: str | None,
    *,
    rng: random.Random,
    delay: tuple[float, float] = (0.0, 0.3),
    env: dict[str, str] | None = None,
    rerun_env: dict[str, str] | None = None,
    rerun: Callable[[], object] | None = None,
) -> JobOutcome:
    """One round of a :class:`KillPlan`: run ``job`` and kill it at ``point`` (or, for
    ``point=None``, after a random delay in ``delay``), record the kill, then run it again
    to the end (in a subprocess, or by calling ``rerun`` in this process). Returns the
    outcome of the first run (``killed`` says if it died)."""
    if point is None:
        outcome = run_job(warehouse, job, now, kill_after_s=rng.uniform(*delay), env=env)
    else:
        outcome = run_job(warehouse, job, now, crash_at=point, env=env)
        assert outcome.killed, outcome.stderr[-2000:]
    plan.record(outcome.killed)
    if rerun is not None:
        rerun()
        return outcome
    again = run_job(warehouse, job, now, env=rerun_env if rerun_env is not None else env)
    assert again.returncode == 0, again.stderr[-3000:]
    return outcome


class CrashRounds:
    """A crash test's set-up in one object: the ``warehouse`` its jobs run on, a
    :class:`KillPlan` over ``points`` (``plan`` options: ``each``, ``random_rounds``,
    ``want``, ``most_random``) and ``rng``, a ``random.Random(seed)`` that draws the
    random kills' delays (a test may draw its data from it too, in the same sequence).
    Iterating it gives the plan's rounds; :meth:`kill_and_rerun` runs one, with this
    test's ``delay`` and ``env`` unless the call gives its own."""

    def __init__(
        self,
        warehouse: str | Path,
        points: list[str],
        *,
        seed: int,
        delay: tuple[float, float] = (0.0, 0.3),
        env: dict[str, str] | None = None,
        **plan: int,
    ) -> None:
        self.warehouse = warehouse
        self.plan = KillPlan(points, **plan)
        self.rng = random.Random(seed)
        self.delay, self.env = delay, env

    def __iter__(self) -> Iterator[tuple[str | None, str | None]]:
        return iter(self.plan)

    @property
    def kills(self) -> int:
        """Kills that really happened so far."""
        return self.plan.kills

    def kill_and_rerun(self, job: str, now: int, point: str | None, **kwargs) -> JobOutcome:
        """:func:`kill_and_rerun` for one round of this plan (same keywords)."""
        kwargs.setdefault("delay", self.delay)
        kwargs.setdefault("env", self.env)
        return kill_and_rerun(self.plan, self.warehouse, job, now, point, rng=self.rng, **kwargs)


class Crashed(RuntimeError):
    """Raised by :func:`crash_at` at its crash point."""


@contextmanager
def crash_at(point: str, nth: int = 1) -> Iterator[None]:
    """Inside the block, code running in this process stops at crash point ``point``
    (``deltamq.faults.point``) the ``nth`` time it gets there, by raising :class:`Crashed`
    ("killed at <point>") — the in-process counterpart of ``run_job(crash_at=...)``,
    for tests that resume the interrupted work in the same process. Other points pass
    as usual; the real ``faults.point`` is back after the block."""
    from deltamq import faults

    real_point = faults.point
    seen = 0

    def point_or_crash(name: str) -> None:
        nonlocal seen
        if name == point:
            seen += 1
            if seen >= nth:
                raise Crashed(f"killed at {point}")
        real_point(name)

    faults.point = point_or_crash
    try:
        yield
    finally:
        faults.point = real_point
