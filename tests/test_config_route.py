"""Configuration has one route: the broker's context. ``Broker.reconfigure`` reaches
every part that acts on a setting — commit retries, dispatch's batch of versions,
lease times — and settings fixed when the broker opened are refused with a reason."""

from __future__ import annotations

import pytest

from deltamq import Message
from deltamq.errors import CommitConflict, ConfigError


def test_reconfigure_reaches_the_engine_the_leases_and_dispatch(broker, clock):
    broker.create_topic("orders", queues=1)
    p = broker.producer("shop")
    for i in range(8):  # eight commits to commit_log
        p.send(Message("orders", f"m{i}".encode()))
    broker.reconfigure(commit_retries=0, dispatch_max_versions=5, lease_ttl_ms=123_456)

    attempts = []

    def conflicting() -> None:
        attempts.append(1)
        raise RuntimeError("io.delta.exceptions.ConcurrentAppendException: another writer committed first")

    with pytest.raises(CommitConflict, match="after 0 retries"):
        broker.context.commit(conflicting, what="test")
    assert len(attempts) == 1  # no retry

    run = broker.tick(clock.now_ms())
    assert run.job("dispatch").result.commits_read == 5  # five versions a pass
    lease = broker.sql("SELECT expires_at - acquired_at AS ttl FROM leases WHERE job = 'dispatch'").collect()
    assert [r["ttl"] for r in lease] == [123_456]


def test_settings_fixed_at_open_are_refused_by_reconfigure(broker):
    opened = broker.config.engine
    for change in ({"engine": "classic"}, {"remote": "sc://elsewhere:15002"}, {"storage_options": {}}):
        with pytest.raises(ConfigError, match="fixed when the broker opened"):
            broker.reconfigure(**change)
    assert broker.config.engine == opened


def test_reconfigure_rejects_a_bad_value_and_keeps_the_old_one(broker):
    with pytest.raises(ConfigError, match="commit_retries"):
        broker.reconfigure(commit_retries=-1)
    assert broker.config.commit_retries == 8
