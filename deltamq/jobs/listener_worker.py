"""Running listeners in isolated worker processes.

Embedded Sail runs ``mapInPandas`` functions inside the broker's own process (docs/design.md, measured facts),
so a listener that calls ``os._exit``, segfaults or hangs would take the broker with it.
Each listener call therefore goes to a worker process (spawned once, reused across
calls and ticks, replaced when it dies): a worker that dies mid-call ends the call with
no outcome ("poison"), one that exceeds the consume timeout is killed ("timeout").

A chunk that ends without an outcome is split into single messages and each is tried
alone, up to ``poison_tries`` times in all; a message whose worker still dies gets the
outcome ``poison`` (the caller dead-letters it), so one bad message never stalls its
group. A message that runs past the timeout alone gets ``timeout`` (retried like a
failure) and ends the call: the rest wait for the next pass (``consume``).

Messages travel to the worker as one Arrow IPC stream per chunk (no per-message
pickling), and the worker builds the ``StoredMessage`` objects the listener sees; the
reply is one small tuple per chunk. ``consume`` answers with *spans* — runs of messages
sharing one outcome — so a million consumed messages are a handful of Python objects.

This module imports only the standard library, pyarrow, ``deltamq.message`` and
``deltamq.body_reads`` (numpy, pyarrow) so that workers start fast.
"""

from __future__ import annotations

import hashlib
import io
import operator
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from deltamq.constants import FailReason
from deltamq.pipes import readable

if TYPE_CHECKING:
    from deltamq.body_reads import BodyFiles

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows
    fcntl = None  # type: ignore[assignment]

_IDLE: dict[str, list[_Worker]] = {}
_IDLE_LOCK = threading.Lock()
_MAX_IDLE_PER_LISTENER = 4
_MAX_IDLE = 16  # idle workers of all listeners together
_START_TIMEOUT_S = 120.0


class WorkerNotStarted(RuntimeError):
    """A listener worker could not load its listener (its module is gone, say)."""


@dataclass(frozen=True)
class Outcome:
    """Result of one message: ``ok`` (consumed) or failed with a requested level, or no
    outcome at all (``reason`` poison / timeout), or not handed over because the listener
    itself could not be loaded (``reason`` setup)."""

    ok: bool
    level: int = 0
    reason: FailReason | None = None
    error: str | None = None
    nbytes: int = 0  # bodies a worker read itself (body_reads) and handed over, on a call's first span


Reply = tuple[bool, int, int, "str | None", int, int]
"""A worker's answer to one chunk: (ok, ack index, requested level, error, why the chunk
was not taken (:data:`NOT_LOADED`, :data:`NOT_READ`: ``SETUP``; else 0), bytes of the
bodies it read itself)."""
NOT_LOADED = 1
"""A reply's fifth field: the listener cannot be loaded (nor will it for the call's other
chunks)."""
NOT_READ = 2
"""A reply's fifth field: the chunk's bodies could not be read from their files."""


def _send(stream: IO[bytes], obj: Any) -> None:
    _send_raw(stream, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _send_raw(stream: IO[bytes], data: bytes) -> None:
    stream.write(struct.pack(">Q", len(data)))
    stream.write(data)
    stream.flush()


def _recv_raw(stream: IO[bytes]) -> bytes:
    head = _read(stream, 8)
    if len(head) < 8:
        raise EOFError("worker stream closed")
    (size,) = struct.unpack(">Q", head)
    data = _read(stream, size)
    if len(data) < size:
        raise EOFError("worker stream closed mid-frame")
    return data


def _read(stream: IO[bytes], n: int) -> bytes:
    """``n`` bytes of ``stream``, or fewer where it ends (an unbuffered pipe returns what
    has arrived, so it is read until ``n`` are in)."""
    parts, got = [], 0
    while got < n:
        part = stream.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _recv(stream: IO[bytes]) -> Any:
    return pickle.loads(_recv_raw(stream))


SEGMENT_CHUNKS = 8
"""Chunks a request to a worker holds at most (concurrent groups; fewer when eight would
not fit twice in its pipe): one request, a reply per chunk, the costs of a request paid
once for them all."""
PIPE_BYTES = 1 << 20
"""The pipe buffer a chunk travels through (Linux: up to ``/proc/sys/fs/pipe-max-size``,
1 MiB by default). With the default 64 KiB a chunk of 1 000 × 1 KiB took 16 hand-overs
between the two processes: 2.4 s per million messages against 1.0 s."""


def _widen(stream: IO[bytes]) -> int:
    """Give a pipe :data:`PIPE_BYTES` of buffer where the system allows (best effort:
    elsewhere, or above the system's limit, the pipe keeps its size); the size it has
    (64 KiB, Linux's default, where it cannot be read)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    get_size = getattr(fcntl, "F_GETPIPE_SZ", None) if fcntl is not None else None
    if set_size is not None:
        try:
            fcntl.fcntl(stream.fileno(), set_size, PIPE_BYTES)
        except OSError:
            pass
    if get_size is not None:
        try:
            return int(fcntl.fcntl(stream.fileno(), get_size))
        except OSError:
            pass
    return 64 << 10


def to_ipc(messages: Any) -> Any:
    """A pyarrow Table as one Arrow IPC stream (a buffer)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, messages.schema) as writer:
        writer.write_table(messages)
    return sink.getvalue()


def read_chunk(ipc: bytes) -> Any:
    """An IPC chunk as one pyarrow RecordBatch (what a columnar listener gets)."""
    import pyarrow as pa

    table = pa.ipc.open_stream(ipc).read_all().combine_chunks()
    batches = table.to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def stored_messages(chunk: Any) -> list[Any]:
    """The StoredMessage objects of a chunk (IPC bytes or a RecordBatch), as the listener
    sees them."""
    from deltamq.message import StoredMessage, messages_of

    if isinstance(chunk, bytes | bytearray | memoryview):
        chunk = read_chunk(bytes(chunk))
    return messages_of(chunk, StoredMessage)


def _worker_main() -> None:  # pragma: no cover - runs in the worker process
    # The protocol owns the original stdout and stdin: whatever the listener prints goes
    # to stderr, and what it reads from stdin is an empty file (a listener reading stdin
    # would otherwise take the protocol's next request)
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    proto_in = os.fdopen(os.dup(0), "rb")
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    sys.path[:] = _recv(proto_in)
    try:
        listener = _recv(proto_in)
    except Exception as e:  # noqa: BLE001 - told to the broker: the listener cannot be loaded
        _send(proto_out, ("not loaded", f"{type(e).__name__}: {e}"))
        return

    from deltamq.body_reads import BodyReader
    from deltamq.constants import MAX_ERROR_CHARS
    from deltamq.consumer import (
        SUCCESS_STATUSES,
        ConsumeContext,
        ImportPathListener,
        failed_status_text,
        is_columnar,
    )
    from deltamq.errors import ListenerUnavailable

    reader = BodyReader()
    _send(proto_out, "ready")  # start-up is not part of any call's timeout

    def answer(group: str, instance: str | None, chunk: Any, files: Any) -> Reply:
        n = chunk.num_rows
        nbytes = 0
        if files is not None:  # the bodies are read here, from the files (body_reads)
            try:
                chunk, nbytes = _with_bodies(reader, chunk, files)
            except Exception as e:  # noqa: BLE001 - not the messages' fault: held, and told
                why = f"the messages' bodies could not be read: {type(e).__name__}: {e}"
                return (False, -1, 0, why[:MAX_ERROR_CHARS], NOT_READ, 0)
        ctx = ConsumeContext(group=group, ack_index=n - 1, instance=instance)
        error = None
        setup = 0
        try:
            fn = listener.target() if isinstance(listener, ImportPathListener) else listener
            status = fn(chunk if is_columnar(fn) else stored_messages(chunk), ctx)
        except BaseException as e:  # noqa: BLE001 - any failure of the listener is RECONSUME_LATER
            status, error = None, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
            if isinstance(e, ListenerUnavailable):  # not the message's fault: nothing consumed
                setup = NOT_LOADED
        ok = isinstance(status, str) and status in SUCCESS_STATUSES
        if not ok and error is None:
            error = failed_status_text(status)[:MAX_ERROR_CHARS]
        # an unreadable field reads as 0: a success whose ack_index cannot be read counts
        # nothing as consumed; a failure keeps its own error, with the level's problem after it
        ack, bad_ack = _integer(ctx.ack_index, "ack_index")
        level, bad_level = _integer(ctx.delay_level_when_next_consume, "delay_level_when_next_consume")
        if ok and bad_ack:
            ok, ack, error = False, -1, bad_ack[:MAX_ERROR_CHARS]
        elif not ok and bad_level:
            error = f"{error}; {bad_level}"[:MAX_ERROR_CHARS]
        return (ok, max(-1, min(ack, n - 1)), level, error, setup, nbytes)

    while True:
        try:
            request = _recv(proto_in)
        except EOFError:
            return
        if request is None:
            return
        group, instance, files, size = request
        try:
            rows = read_chunk(_recv_raw(proto_in))
        except EOFError:
            return
        # a request holds one chunk or several in a row (``size`` each): one reply per chunk
        for lo in range(0, max(rows.num_rows, 1), size):
            _send(proto_out, answer(group, instance, rows.slice(lo, size), files))


def _with_bodies(reader: Any, chunk: Any, files: Any) -> tuple[Any, int]:
    """``chunk`` with its bodies read from ``files`` (body_reads), and their bytes."""
    import pyarrow.compute as pc

    from deltamq.consumer import COLUMNAR_COLUMNS

    chunk = reader.resolve(chunk, files, COLUMNAR_COLUMNS)
    return chunk, int(pc.sum(pc.binary_length(chunk.column("body"))).as_py() or 0)


def _integer(value: Any, name: str) -> tuple[int, str | None]:
    """A context field the listener set, as an int (numpy's integers too), or 0 and why
    it is not one."""
    if not isinstance(value, bool):
        try:
            return operator.index(value), None
        except TypeError:
            pass
    return 0, f"{name}={value!r} is not an integer"


class _Worker:
    """A listener worker: ``python -m deltamq.jobs.listener_worker`` on pipes (not
    multiprocessing, whose spawn re-imports the parent's main module)."""

    def __init__(self, key: str, listener_bytes: bytes, home: Home) -> None:
        self.key = key
        env = dict(home.env)
        env.pop("DELTAMQ_CRASH_AT", None)  # crash points are for the broker, not its workers
        self.proc = subprocess.Popen(
            # -P: the current directory is not put first on the path, so a folder there
            # named like a package (a clone's parent holds ``deltamq/``) cannot shadow it;
            # the listener's own path is the broker's sys.path, sent below
            [sys.executable, "-P", "-m", "deltamq.jobs.listener_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # the replies unbuffered: with chunks sent ahead, a buffer could hold the next
            # reply read ahead while poll() waits on the pipe for it
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # PIPE above
        self.stdin: IO[bytes] = io.BufferedWriter(self.proc.stdin, PIPE_BYTES)
        self.stdout: IO[bytes] = self.proc.stdout
        self.pipe_bytes = _widen(self.stdin)
        _widen(self.stdout)
        _send(self.stdin, list(home.sys_path))
        _send_raw(self.stdin, listener_bytes)
        ready = readable(self.stdout, _START_TIMEOUT_S)
        said: Any = None
        try:
            said = _recv(self.stdout) if ready else None
        except (EOFError, pickle.UnpicklingError):
            pass
        if said != "ready":
            self.kill()
            why = said[1] if isinstance(said, tuple) else "it ended or did not answer; see its stderr"
            raise WorkerNotStarted(f"listener worker did not start: the listener cannot be loaded: {why}")

    def call(
        self, group: str, instance: str | None, ipc: Any, timeout_s: float, files: BodyFiles | None = None
    ) -> Reply | str:
        """The worker's reply to one chunk (its bodies read from ``files`` when given), or
        "poison" (it died) or "timeout" (it was killed)."""
        self.send(group, instance, ipc, files)
        return self.receive(timeout_s)

    def send(
        self, group: str, instance: str | None, ipc: Any, files: BodyFiles | None = None, size: int = 0
    ) -> None:
        """Hand the worker a chunk, or chunks of ``size`` rows in a row; :meth:`receive`
        reads a reply per chunk, in the order sent. A worker that is gone answers the next
        receive with "poison" (once any reply it wrote before has been read)."""
        try:
            _send(self.stdin, (group, instance, files, size or 1 << 62))
            _send_raw(self.stdin, ipc)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def receive(self, timeout_s: float) -> Reply | str:
        """The reply to the oldest chunk sent and not answered yet, or "poison" (the
        worker died) or "timeout" (it ran past ``timeout_s`` and was killed)."""
        try:
            if not readable(self.stdout, timeout_s):
                self.kill()
                return "timeout"
            reply: Reply = _recv(self.stdout)
            return reply
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError, ValueError, pickle.UnpicklingError):
            self.kill()
            return "poison"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.stdin, self.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def stop(self) -> None:
        try:
            _send(self.stdin, None)
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass(frozen=True)
class Home:
    """The broker process's environment and ``sys.path``, for workers started by a
    server in another process (the embedded Sail server runs listener code in its own
    process: a listener must see the broker's environment, as it would in-process)."""

    env: tuple[tuple[str, str], ...]
    sys_path: tuple[str, ...]

    @classmethod
    def here(cls) -> Home:
        return cls(tuple(sorted(os.environ.items())), tuple(p for p in sys.path if isinstance(p, str)))

    def digest(self) -> str:
        return hashlib.sha256(pickle.dumps((self.env, self.sys_path))).hexdigest()


def _take(key: str, listener_bytes: bytes, home: Home) -> _Worker:
    with _IDLE_LOCK:
        pool = _IDLE.get(key, [])
        while pool:
            w = pool.pop()
            if w.alive:
                return w
    return _Worker(key, listener_bytes, home)


def _give_back(w: _Worker) -> None:
    if not w.alive:
        return
    surplus = [w]
    with _IDLE_LOCK:
        pool = _IDLE.pop(w.key, [])
        _IDLE[w.key] = pool  # most recently used last
        if len(pool) < _MAX_IDLE_PER_LISTENER:
            pool.append(w)
            surplus = []
        # listeners not used for a while give their idle workers back first
        while sum(len(p) for p in _IDLE.values()) > _MAX_IDLE:
            oldest = next(k for k, p in _IDLE.items() if p)
            surplus.append(_IDLE[oldest].pop(0))
            if not _IDLE[oldest]:
                del _IDLE[oldest]
    for extra in surplus:
        extra.stop()


Span = tuple[int, int, Outcome]
"""(first index, count, outcome): ``count`` consecutive messages with one outcome."""


def consume(
    listener_bytes: bytes,
    group: str,
    messages: Any,
    batch_size: int,
    timeout_s: float,
    poison_tries: int,
    instance: str | None = None,
    home: Home | None = None,
    *,
    in_order: bool = False,
    files: BodyFiles | None = None,
) -> list[Span]:
    """Hand ``messages`` (a pyarrow Table of consume_queue + commit_log columns) to the
    listener in chunks of ``batch_size``; the outcomes as spans covering every message
    once, in order. A chunk whose worker died is tried again a message at a time (to find
    the message at fault); ``in_order`` (an orderly group) stops at the first of those
    that fails: no message reaches the listener before the ones ahead of it have
    succeeded, and the rest are ``NOT_DELIVERED``. A chunk that runs past ``timeout_s``
    is tried a message at a time too, up to the first message that runs past it alone:
    that one fails with ``TIMEOUT`` (retried, as a RocketMQ consumer sends back what it
    consumed too long) and the rest of the call is ``DEFERRED`` (``NOT_DELIVERED`` in
    order), so a listener that hangs on everything (a dependency down) costs two
    timeouts per call, not two per message. Workers run with ``home``'s environment and
    path (default: this process's); workers of another home are not reused. With
    ``files``, ``messages`` carry where their bodies lie instead of the bodies, and the
    worker reads them (body_reads); the bytes it read are on each call's first span. A
    listener that cannot be loaded (``SETUP``, :data:`NOT_LOADED`) is sent nothing more:
    the chunks already sent are answered, the rest is ``SETUP`` too, untried (a pass of
    300 000 messages for such a listener took 95 s in chunks of one). A chunk whose
    bodies cannot be read (:data:`NOT_READ`) is ``SETUP`` alone: the next chunks' files
    may be readable."""
    home = home or Home.here()
    key = hashlib.sha256(listener_bytes).hexdigest() + home.digest()
    try:
        to = _Caller(
            key, listener_bytes, home, group, instance, timeout_s, files, _take(key, listener_bytes, home)
        )
    except WorkerNotStarted as e:  # not the messages' fault: nothing consumed, nothing retried
        return [(0, messages.num_rows, Outcome(False, reason=FailReason.SETUP, error=str(e)))]
    spans: list[Span] = []
    header = len(pickle.dumps((group, instance, files, batch_size), protocol=pickle.HIGHEST_PROTOCOL))
    flow = _Flow(messages, batch_size, in_order, to.worker.pipe_bytes, header)
    unsent: tuple[int, str | None] | None = None  # from where, and why, the rest was not sent
    try:
        while flow.left:
            flow.fill(to)
            k = flow.answered()
            start, chunk = flow.starts[k], messages.slice(flow.starts[k], batch_size)
            reply = to.worker.receive(timeout_s)
            if isinstance(reply, tuple):
                spans.extend(_apply(reply, start, chunk.num_rows))
                if reply[4] == NOT_LOADED and unsent is None:  # nor will it for the chunks not sent
                    unsent = (flow.stop(), reply[3])  # (those sent are answered: the worker ran them)
                continue
            flow.lost()  # what the gone worker had not answered goes to the next one
            if reply == FailReason.TIMEOUT and chunk.num_rows == 1:  # the worker was stopped
                return spans + _timed_out(start, 1, messages.num_rows, in_order)
            # a chunk of several that died or timed out: its messages one at a time, so one
            # that hangs does not take the others with it (up to the first that times out alone)
            to.fresh()
            if _one_at_a_time(to, chunk, start, reply, poison_tries, messages.num_rows, in_order, spans):
                return spans
        if unsent is not None and unsent[0] < messages.num_rows:
            rest = Outcome(False, reason=FailReason.SETUP, error=unsent[1])
            spans.append((unsent[0], messages.num_rows - unsent[0], rest))
    except WorkerNotStarted as e:  # a restart after a crash failed: the rest is not consumed
        done = sum(n for _, n, _ in spans)
        spans.append((done, messages.num_rows - done, Outcome(False, reason=FailReason.SETUP, error=str(e))))
        return spans
    finally:
        if flow.sent:  # left with chunks it has not answered (an error here): not reused
            to.worker.kill()
        _give_back(to.worker)
    return spans


class _Flow:
    """The chunks of one :func:`consume` on their way to the current worker: several
    chunks per request, and the next request sent before the replies to the last one
    are read, so a worker never waits for the broker between chunks. A request goes
    ahead only when it fits in the worker's pipe beside the one the worker is on (a
    write that blocked would keep the broker from its timeouts, and from reading the
    replies the worker is blocked writing). In order (an orderly group), one chunk at a
    time: no message there reaches the listener before the ones ahead of it succeeded."""

    def __init__(
        self, messages: Any, batch_size: int, in_order: bool, pipe_bytes: int, header_bytes: int
    ) -> None:
        self.messages, self.batch_size, self.in_order = messages, batch_size, in_order
        self.starts = range(0, messages.num_rows, batch_size)
        self.pending = deque(range(len(self.starts)))  # chunks not handed to the worker
        self.sent: deque[tuple[deque[int], int]] = deque()  # requests: chunks unanswered, bytes
        self.header = header_bytes + 64  # a request's own frame beside its rows
        per_chunk = messages.nbytes / max(1, messages.num_rows) * batch_size
        half = (pipe_bytes - self.header) // 2
        self.per = 1 if in_order else max(1, min(SEGMENT_CHUNKS, int(half // max(1.0, per_chunk))))
        self._ready: tuple[list[int], Any] | None = None  # the next request, built

    @property
    def left(self) -> bool:
        """Whether any chunk is still to be answered (sent or not, a request built)."""
        return bool(self.pending or self.sent or self._ready is not None)

    def fill(self, to: _Caller) -> None:
        """Send what may go now (nothing while the worker has a request and another may
        not go beside it)."""
        while self.pending or self._ready is not None:
            if self.sent and (self.in_order or len(self.sent) > 1):
                return
            if self._ready is None:
                segment = [self.pending.popleft() for _ in range(min(self.per, len(self.pending)))]
                rows = self.messages.slice(self.starts[segment[0]], len(segment) * self.batch_size)
                self._ready = (segment, to_ipc(rows))
            segment, ipc = self._ready
            # the current worker's pipe (a worker taken after one died may have a smaller one)
            if self.sent and self.sent[0][1] + ipc.size > to.worker.pipe_bytes - self.header:
                return  # it would not fit beside the worker's request: sent once that is answered
            to.send(ipc, self.batch_size)
            self.sent.append((deque(segment), ipc.size))
            self._ready = None

    def answered(self) -> int:
        """The chunk the next reply is for."""
        chunks, _ = self.sent[0]
        k = chunks.popleft()
        if not chunks:
            self.sent.popleft()
        return k

    def stop(self) -> int:
        """Nothing more is sent (what was sent is still answered): the first row of the
        chunks not sent (the rows' count when every chunk was)."""
        left = ([*self._ready[0]] if self._ready else []) + list(self.pending)
        self.pending.clear()
        self._ready = None
        return self.starts[min(left)] if left else self.messages.num_rows

    def lost(self) -> None:
        """The worker is gone: the chunks it had not answered, and the request built for
        it, go back ahead of the rest, in order."""
        back = [k for chunks, _ in self.sent for k in chunks] + (self._ready[0] if self._ready else [])
        self.pending.extendleft(reversed(back))
        self.sent.clear()
        self._ready = None


@dataclass
class _Caller:
    """One :func:`consume`'s way to its listener's workers: the worker in use (another
    taken when it dies) and what every chunk is sent with."""

    key: str
    listener_bytes: bytes
    home: Home
    group: str
    instance: str | None
    timeout_s: float
    files: BodyFiles | None
    worker: _Worker

    def fresh(self) -> None:
        self.worker = _take(self.key, self.listener_bytes, self.home)

    def send(self, ipc: Any, size: int) -> None:
        self.worker.send(self.group, self.instance, ipc, self.files, size)

    def call(self, ipc: Any) -> Reply | str:
        return self.worker.call(self.group, self.instance, ipc, self.timeout_s, self.files)


def _one_at_a_time(
    to: _Caller,
    chunk: Any,
    start: int,
    reply: str,
    poison_tries: int,
    total: int,
    in_order: bool,
    spans: list[Span],
) -> bool:
    """A chunk's messages tried alone after the chunk's call (the first try of each)
    ended with ``reply`` ("poison" or "timeout"), their spans added to ``spans`` as they
    come (a worker that cannot be restarted midway leaves those in place); whether the
    call ends here (a message timed out alone, or one failed in order)."""
    for i in range(chunk.num_rows):
        one = to_ipc(chunk.slice(i, 1))
        result: Reply | str = reply
        for _ in range(poison_tries - 1):
            result = to.call(one)
            if isinstance(result, tuple) or result == FailReason.TIMEOUT:
                break
            to.fresh()
        if isinstance(result, tuple):
            spans.extend(_apply(result, start + i, 1))
        elif result == FailReason.TIMEOUT:
            spans += _timed_out(start + i, 1, total, in_order)
            return True
        else:
            error = f"listener ended without an outcome ({result})"
            spans.append((start + i, 1, Outcome(False, reason=FailReason(result), error=error)))
        if in_order and not spans[-1][2].ok:
            left = total - (start + i + 1)
            if left:
                spans.append((start + i + 1, left, Outcome(False, reason=FailReason.NOT_DELIVERED)))
            return True
    return False


def _timed_out(start: int, n: int, total: int, in_order: bool) -> list[Span]:
    """``n`` messages from ``start`` ran past the consume timeout; the rest of the call's
    ``total`` are not handed over."""
    error = "the listener ran past the consume timeout (consume_timeout_ms) and was stopped"
    spans: list[Span] = [(start, n, Outcome(False, reason=FailReason.TIMEOUT, error=error))]
    if start + n < total:
        rest = FailReason.NOT_DELIVERED if in_order else FailReason.DEFERRED
        spans.append((start + n, total - start - n, Outcome(False, reason=rest)))
    return spans


def _apply(reply: Reply, start: int, n: int) -> list[Span]:
    ok, ack, level, error, setup, nbytes = reply
    if setup:  # the listener could not even be loaded: no message was consumed
        return [(start, n, Outcome(False, reason=FailReason.SETUP, error=error))]
    if not ok:
        return [(start, n, Outcome(False, level=level, error=error, nbytes=nbytes))]
    spans: list[Span] = [(start, ack + 1, Outcome(True, nbytes=nbytes))] if ack >= 0 else []
    if ack + 1 < n:
        left = Outcome(False, level=level, error="after ack_index", nbytes=0 if spans else nbytes)
        spans.append((start + ack + 1, n - ack - 1, left))
    return spans


def shutdown() -> None:
    """Stop every idle worker (tests; workers are daemons and die with the process)."""
    with _IDLE_LOCK:
        workers = [w for pool in _IDLE.values() for w in pool]
        _IDLE.clear()
    for w in workers:
        w.kill()


if __name__ == "__main__":  # pragma: no cover - the worker process
    _worker_main()
