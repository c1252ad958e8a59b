"""The broker's side of the listener workers (deltamq/jobs/listener_worker.py): chunks
sent several to a request and a request ahead, with a listener that hangs, one that fails
fast with long errors, and a worker that cannot be restarted midway. Chunks of 200 KiB
bodies do not fit twice in a worker's pipe: a write that blocked would keep the broker
from its timeouts and from the replies the worker is blocked writing."""

from __future__ import annotations

import pickle
import time

import pyarrow as pa
import pytest
from support.listeners import Recorder

from deltamq.constants import FailReason
from deltamq.jobs import listener_worker
from deltamq.jobs.listener_worker import Outcome, WorkerNotStarted, consume


@pytest.fixture(autouse=True)
def _no_idle_workers():
    yield
    listener_worker.shutdown()


def _messages(bodies: list[bytes]) -> pa.Table:
    """A chunk's columns as deliver hands them over (consumer.COLUMNAR_COLUMNS)."""
    n = len(bodies)
    return pa.table(
        {
            "topic": ["orders"] * n,
            "queue_id": pa.array([0] * n, pa.int32()),
            "queue_offset": pa.array(range(n), pa.int64()),
            "msg_id": [f"id{i}" for i in range(n)],
            "tags": pa.nulls(n, pa.string()),
            "keys": pa.nulls(n, pa.string()),
            "body": pa.array(bodies, pa.binary()),
            "properties": pa.nulls(n, pa.map_(pa.string(), pa.string())),
            "born_ts": pa.array([1] * n, pa.int64()),
            "store_ts": pa.array([2] * n, pa.int64()),
            "reconsume_times": pa.array([0] * n, pa.int32()),
            "suspends": pa.array([0] * n, pa.int32()),
            "flag": pa.array([0] * n, pa.int32()),
            "sys_flag": pa.array([0] * n, pa.int32()),
        }
    )


WIDE = 200 * 1024


def test_a_listener_that_hangs_is_stopped_at_its_timeout_whatever_the_chunks_size(tmp_path):
    bodies = [b"sleep"] + [b"ok" + b"x" * WIDE for _ in range(15)]
    listener = pickle.dumps(Recorder(tmp_path / "calls.jsonl", "hostile"))
    started = time.monotonic()
    spans = consume(listener, "g", _messages(bodies), 1, 1.0, 3)
    assert time.monotonic() - started < 5  # the timeout, not the 30 s the listener sleeps
    assert spans[0][:2] == (0, 1) and spans[0][2].reason == FailReason.TIMEOUT
    assert spans[1][:2] == (1, 15) and spans[1][2].reason == FailReason.DEFERRED


@pytest.mark.timeout(60)
def test_fast_failures_with_long_errors_do_not_deadlock_the_pipes(tmp_path):
    bodies = [b"m" + b"x" * WIDE for _ in range(32)]
    listener = pickle.dumps(Recorder(tmp_path / "calls.jsonl", "raise_long"))
    spans = consume(listener, "g", _messages(bodies), 1, 10.0, 3)
    assert sum(n for _, n, _ in spans) == 32 and all(
        not o.ok and "订单" in (o.error or "") for _, _, o in spans
    )


def test_messages_consumed_alone_keep_their_outcome_when_a_worker_cannot_be_restarted(tmp_path, monkeypatch):
    """A chunk's worker dies; its messages go one at a time: the first succeeds, the
    second kills its worker too, and no worker can be started after that: the first
    keeps its success, the rest are SETUP (held, tried again on the next pass)."""
    real, taken = listener_worker._take, []

    def take(*args, **kwargs):
        taken.append(1)
        if len(taken) >= 3:
            raise WorkerNotStarted("listener worker did not start: (a test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(listener_worker, "_take", take)
    listener = pickle.dumps(Recorder(tmp_path / "calls.jsonl", "exit_on_any"))
    spans = consume(listener, "g", _messages([b"a", b"exit", b"b"]), 3, 10.0, 3)
    assert spans[0] == (0, 1, Outcome(True))
    assert spans[1][:2] == (1, 2) and spans[1][2].reason == FailReason.SETUP


def test_several_chunks_a_request_answer_each_chunk_in_order(tmp_path):
    from support.listeners import read_log

    log = tmp_path / "calls.jsonl"
    bodies = [f"m{i}".encode() for i in range(50)]
    spans = consume(pickle.dumps(Recorder(log, "ok")), "g", _messages(bodies), 4, 10.0, 3)
    assert spans == [(i, min(4, 50 - i), Outcome(True)) for i in range(0, 50, 4)]
    calls = read_log(log)
    assert [c["body"] for c in calls] == [f"m{i}" for i in range(50)]
    assert [c["batch"] for c in calls][::4] == [4] * 12 + [2]


def test_chunks_too_large_to_go_ahead_are_all_answered(tmp_path):
    """Chunks of 600 KiB: two do not fit in a worker's pipe, so each waits for the one
    before it to be answered; every one is handed over and answered once."""
    from support.listeners import read_log

    log = tmp_path / "calls.jsonl"
    bodies = [b"%d" % i + b"x" * (600 * 1024) for i in range(5)]
    spans = consume(pickle.dumps(Recorder(log, "ok")), "g", _messages(bodies), 1, 10.0, 3)
    assert spans == [(i, 1, Outcome(True)) for i in range(5)]
    assert [c["body"][:1] for c in read_log(log)] == [str(i) for i in range(5)]


def test_a_listener_reading_stdin_finds_it_empty_and_the_requests_intact(tmp_path):
    """The protocol's requests come on the worker's original stdin: a listener reading
    its stdin gets an empty file, not the next chunks (several chunks to a request, the
    next request ahead)."""
    from support.listeners import read_log

    listener = pickle.dumps(Recorder(tmp_path / "calls.jsonl", "read_stdin"))
    bodies = [f"m{i}".encode() for i in range(41)]  # 21 chunks: three requests, one ahead
    spans = consume(listener, "g", _messages(bodies), 2, 10.0, 3)
    assert [(lo, n, o.ok) for lo, n, o in spans] == [(lo, min(2, 41 - lo), True) for lo in range(0, 41, 2)]
    assert sorted(c["body"] for c in read_log(tmp_path / "calls.jsonl")) == sorted(b.decode() for b in bodies)


def test_a_listener_that_cannot_load_is_sent_nothing_more_after_its_first_answer(tmp_path):
    """The first chunk's answer says the listener cannot be loaded: the chunks already sent
    are answered (the worker ran them), nothing more is sent, the rest is held the same
    way in one span, and the worker goes back to the pool."""
    from support.listeners import read_log

    listener = pickle.dumps(Recorder(tmp_path / "calls.jsonl", "unavailable"))
    spans = consume(listener, "g", _messages([f"m{i}".encode() for i in range(50)]), 1, 10.0, 3)
    *sent, (lo, n, rest) = spans
    assert [(a, k) for a, k, _ in sent] == [(a, 1) for a in range(len(sent))] and (lo, n) == (
        len(sent),
        50 - lo,
    )
    assert 1 <= len(sent) <= 2 * listener_worker.SEGMENT_CHUNKS  # a request and one ahead of it
    assert all(o.reason == FailReason.SETUP and "cannot be imported" in (o.error or "") for _, _, o in spans)
    assert len(read_log(tmp_path / "calls.jsonl")) == len(sent)  # every chunk sent was run, no other
    assert sum(len(pool) for pool in listener_worker._IDLE.values()) == 1  # reused, not killed
