"""Spark Connect sessions: how deltamq connects to any endpoint (the embedded Sail server,
a remote Sail, Apache Spark's own Connect server), and the pyspark Connect client
behaviours it works around (docs/engines.md)."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

from deltamq.errors import EngineError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _quiet_late_releases() -> None:
    """pyspark 4.0's Spark Connect result iterator releases its results on the server from
    ``__del__``, through a thread pool shared by every session of the process; closing any
    session shuts that pool down. An unfinished iterator that the garbage collector reaches
    while a close is under way raises ``RuntimeError: cannot schedule new futures after
    shutdown`` from ``__del__``, wherever the collector happened to run — in a test run,
    inside the parser pytest uses to show a failure, which CPython 3.11.7 then reports as
    ``SystemError: AST constructor recursion depth mismatch`` and the run ends
    (docs/engines.md). The release is only a courtesy (a closed session's results go with
    it), so that error is dropped here."""
    try:
        from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as It
    except ImportError:  # pragma: no cover - classic PySpark without Connect
        return
    if getattr(It, "_deltamq_quiet_del", False):
        return
    original = It.__del__

    def __del__(self) -> None:  # noqa: N807 - replaces the class's finaliser
        try:
            original(self)
        except RuntimeError:
            pass

    It.__del__ = __del__  # type: ignore[method-assign]
    It._deltamq_quiet_del = True  # type: ignore[attr-defined]
    # The pool itself stays up. Closing any client shuts it down, and a session that the
    # garbage collector finalises (SparkSession.__del__ closes its client) can do that in
    # the middle of another session's query, in the same thread, between the iterator's
    # check of the pool and its submit (the lock is re-entrant): the live query then fails
    # with the same RuntimeError (seen once in a default-tier run, docs/engines.md). Its
    # idle threads cost nothing; a closed client's pending releases fail quietly.
    It.shutdown = classmethod(lambda cls: None)  # type: ignore[method-assign,assignment]


CONNECT_WAIT_S = 20.0
"""How long :func:`connect` keeps trying to reach an endpoint that refuses connections or
does not answer (a server still starting) before it fails, naming the endpoint."""


def connect(url: str, *, wait_s: float = CONNECT_WAIT_S) -> SparkSession:
    """A Spark Connect session of our own at ``url`` (``create()``: temp views of one
    Broker never clash with another's in the same process). The endpoint is reached first
    (:func:`reach`): pyspark's client would retry an unreachable one for ~10 minutes
    without a word."""
    from pyspark.sql import SparkSession

    reach(url, wait_s)
    _quiet_late_releases()
    _no_dataframe_debugging()
    try:
        return SparkSession.builder.remote(url).create()
    except Exception as e:
        raise EngineError(f"cannot connect to Spark Connect endpoint {url}: {e}") from e


def reach(url: str, wait_s: float) -> None:
    """Open a TCP connection to the Spark Connect endpoint ``url`` (``sc://host:port``,
    port 15002 when not given), trying again for up to ``wait_s`` seconds; EngineError
    naming the endpoint and the last cause when it cannot be reached."""
    host, port = endpoint(url)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, wait_s))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"cannot reach Spark Connect endpoint {url} ({host}:{port}) within {wait_s:g} s: "
                    f"{e.strerror or e}; is its server running, and is the address right?"
                ) from e
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def endpoint(url: str) -> tuple[str, int]:
    """(host, port) of a Spark Connect URL ``sc://host[:port][/;params]``."""
    rest = url[len("sc://") :] if url.startswith("sc://") else url
    hostport = rest.split("/", 1)[0].split(";", 1)[0]
    has_port = hostport.rfind(":") > hostport.rfind("]")  # not a colon of an IPv6 address
    host, _, port = hostport.rpartition(":") if has_port else (hostport, "", "")
    host = host.strip("[]") or "localhost"
    if not port:
        return host, 15002
    if not port.isdigit():
        raise EngineError(f"Spark Connect URL {url!r} has port {port!r}; a port is a number")
    return host, int(port)


def _no_dataframe_debugging() -> None:
    """PySpark's DataFrame debugging off: with it, PySpark walks the stack and tries to
    import IPython on every Column function call (a busy tick's jobs make hundreds: ~40 ms
    of client CPU a tick), only to add the call site to engine error messages. PySpark
    reads the setting once per process from the active session; Apache Spark's server
    refuses to set it per session (a static setting), so the client's cached answer is
    set here."""
    try:
        from pyspark.errors import utils
    except ImportError:  # pragma: no cover
        return
    setattr(utils, "_enable_debugging_cache", False)  # noqa: B010 - a private module global
