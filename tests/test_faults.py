"""Fault injection: a mixed workload (normal, delayed, timer, failing, orderly,
transactional, pull-consumed) with its ticks SIGKILLed at random points, 20 kills or
more; after every kill and re-run, conservation, no duplicate offsets, no copy written
twice; at the end nothing lost. bench/reliability.py runs the same for 500 kills."""

from __future__ import annotations

import pytest
from support.faultload import FaultLoad

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow


def test_twenty_kills_lose_nothing_and_duplicate_nothing(broker, clock, tmp_path):
    load = FaultLoad(broker, clock, tmp_path / "wh", seed=13)
    load.setup()
    r = 0
    while load.figures.kills < 20:
        assert r < 45, f"only {load.figures.kills} kills in {r} rounds"
        load.round(r)
        r += 1
    load.drain()
    f = load.figures
    assert f.kills >= 20 and f.kills_at_points and f.kills_at_random
    assert f.lost == f.duplicate_copies == f.duplicate_offsets == f.unaccounted == 0
    print(f)
