"""The main story on S3 with the store failing (issue 32): the mixed workload of
tests/support/faultload.py plus an exactly-once sink, every request through the fault
proxy. Rounds with random faults, then rounds with faults and SIGKILLed ticks, then the
faults stop and the loop catches up; every failure along the way must have named the
store and its cause (tests/support/store_faultload.py)."""

from __future__ import annotations

import uuid

import pytest
from support.store_faultload import RATES, StoreFaultLoad

from deltamq import Broker
from deltamq.config import BrokerConfig

pytestmark = pytest.mark.slow


def test_the_story_under_store_faults_then_kills_then_none(faults, s3_server, clock):
    location = f"s3://{s3_server.bucket}/story-faults-{uuid.uuid4().hex[:8]}/wh"
    b = Broker.init(location, clock=clock, config=BrokerConfig(storage_options=faults.options))
    try:
        load = StoreFaultLoad(b, clock, location, faults, s3_server.bucket, seed=32)
        load.setup()
        faults.set(rates=RATES, seed=32, reset_counters=True)
        load.round(0, kill=False)  # bench/reliability.py --store-faults runs more rounds
        load.round(1)
        during = faults.state()
        faults.off()
        load.drain()
        quality = b.check_quality()
        assert quality.success, [(f.suite, f.expectation, f.unexpected) for f in quality.failures]
        f, s = load.figures, load.store
        assert sum(during["faulted"].values()) > 0, during
        assert f.lost == f.duplicate_copies == f.duplicate_offsets == f.unaccounted == 0
        assert s.sink_twice == 0
        print(f, s, during["requests"], during["faulted"])
    finally:
        b.close()
