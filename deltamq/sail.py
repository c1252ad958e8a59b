"""The embedded engine's Sail server: a Spark Connect server in a child process
(deltamq/_sail_child.py) that this process starts, replaces and stops.

Only the embedded engine uses this module; :mod:`deltamq.engine` (the SQL and commit
layer) asks it for a session and for the server's memory. Why a child process, and the
pyspark Connect behaviours worked around here: docs/engines.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from deltamq.errors import EngineError
from deltamq.pipes import readable
from deltamq.spark_connect import connect

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 120.0


class EmbeddedServer:
    """The process's Sail Spark Connect server, run in a child process
    (deltamq/_sail_child.py), started on first use and replaced by :meth:`recycle`.

    Sail holds on to ~0.1 MB for every operation it executes and frees it only when its
    process ends (docs/engines.md), so a long-lived broker must be able to swap the
    server for a fresh one: every embedded Engine notices the new ``generation`` and
    reconnects on its next use of ``spark``.
    """

    _lock = threading.RLock()
    _proc: subprocess.Popen | None = None
    _url: str | None = None
    generation = 0
    recycles = 0
    sessions: list = []
    _atexit = False
    # environment the server runs with beyond this process's: the object-store settings
    # of the warehouse whose engine used it last (deltamq/storage.py)
    env: dict[str, str] = {}

    @classmethod
    def require_env(cls, env: dict[str, str]) -> None:
        """Make sure the server runs with exactly ``env`` beyond the process's environment,
        replacing a running one that has other settings. One server serves one set of
        object-store settings at a time: engines of warehouses with other settings swap
        it back on their next use (about a second each time)."""
        with cls._lock:
            if cls.env == env:
                return
            cls.env = dict(env)
            if cls._proc is not None and cls._proc.poll() is None:
                cls.recycle("a warehouse needs other object-store settings")

    @classmethod
    def url(cls) -> str:
        with cls._lock:
            if cls._url is None or cls._proc is None or cls._proc.poll() is not None:
                if cls._proc is not None:
                    log.warning("embedded Sail server (pid %s) is gone; starting another", cls._proc.pid)
                cls._start()
            assert cls._url is not None
            return cls._url

    @classmethod
    def alive(cls) -> bool:
        return cls._proc is not None and cls._proc.poll() is None

    @classmethod
    def _start(cls) -> None:
        env = dict(os.environ) | cls.env
        env.setdefault("RUST_LOG", "error")
        proc = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("_sail_child.py")), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            setup = {"sys_path": [p for p in sys.path if isinstance(p, str)]}
            proc.stdin.write(json.dumps(setup).encode() + b"\n")
            proc.stdin.flush()
            line = proc.stdout.readline().decode().split() if readable(proc.stdout, _START_TIMEOUT_S) else []
            if len(line) != 3 or line[0] != "LISTENING":
                raise EngineError(
                    f"the embedded Sail server did not start within {_START_TIMEOUT_S:.0f}s "
                    f"(exit code {proc.poll()}, said {line!r}); is pysail installed?"
                )
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        cls._proc, cls._url = proc, f"sc://{line[1]}:{line[2]}"
        cls.generation += 1
        if not cls._atexit:
            atexit.register(cls.stop)
            cls._atexit = True
        log.info("embedded Sail server (pid %s) listening on %s", proc.pid, cls._url)

    @classmethod
    def rss_mb(cls) -> float | None:
        """The server process's resident memory in MiB (None: not running or unknown)."""
        proc = cls._proc
        if proc is None or proc.poll() is not None:
            return None
        return resident_mb(proc.pid)

    @classmethod
    def peak_rss_mb(cls) -> float | None:
        """The running server's peak resident memory so far in MiB (its ``VmHWM``; None:
        not running or unknown). A replaced server's peak goes with it."""
        proc = cls._proc
        if proc is None or proc.poll() is not None:
            return None
        return resident_mb(proc.pid, "VmHWM")

    @classmethod
    def recycle(cls, reason: str) -> None:
        """Replace the server by a fresh one; engines reconnect on next use."""
        with cls._lock:
            log.info("replacing the embedded Sail server: %s", reason)
            cls.stop()
            cls._start()
            cls.recycles += 1

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            proc, cls._proc, cls._url = cls._proc, None, None
            # Close our clients while the server still answers: a client finishes its
            # pending ReleaseExecute calls then; against a dead server they would be
            # retried for minutes, holding up the process's exit.
            sessions, cls.sessions = cls.sessions, []
            for spark in sessions:
                try:
                    spark.client.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
            if proc is None:
                return
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - it would not stop: make it
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    @classmethod
    def running(cls) -> bool:
        return cls._url is not None and cls.alive()


def resident_mb(pid: int | str = "self", field: str = "VmRSS") -> float | None:
    """A process's resident memory in MiB (``VmHWM``: its peak so far) from
    ``/proc/<pid>/status`` (None: unknown, e.g. not Linux, which then never replaces its
    embedded server by size)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def embedded_session() -> SparkSession:
    from pyspark.sql.connect.client.retries import DefaultPolicy

    with EmbeddedServer._lock:
        spark = connect(EmbeddedServer.url())
        EmbeddedServer.sessions.append(spark)
    # A local server that stops answering is gone, not busy: give up in ~5 s rather than
    # the client's default ~10 minutes of retries (per query and per ReleaseExecute).
    spark.client.set_retry_policies([DefaultPolicy(max_retries=5, max_backoff=2000)])  # type: ignore[operator]
    _adopt_as_default(spark)
    # Our own server: render times in UTC like the epoch-ms columns (session-local).
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


def _adopt_as_default(spark: SparkSession) -> None:
    """After the embedded server was replaced, the process's default and this thread's
    active Connect session are closed ones: code that finds its session by
    ``SparkSession.builder.getOrCreate()`` (Great Expectations) would try to create one
    without a URL. Make ``spark`` both, where they are unusable."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    with ConnectSession._lock:
        if ConnectSession._get_default_session() is None:
            ConnectSession._default_session = spark  # type: ignore[assignment]
    if ConnectSession.getActiveSession() is None:
        ConnectSession._active_session.session = spark
