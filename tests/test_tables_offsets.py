"""The ``offsets`` table's typed reads (deltamq/tables/offsets.py): consumer positions
and job progress come back as records, the jobs' rows never among the groups'."""

from __future__ import annotations

from deltamq import Message
from deltamq.constants import DISPATCH_GROUP, PROMOTE_GROUP
from deltamq.tables.offsets import START, Position, QueueKey, clients_with_offsets, positions, progress


def test_positions_and_progress_are_typed_and_kept_apart(broker, clock, warehouse_with):
    warehouse_with("orders", queues=2, group="billing", recorder="ok")
    broker.producer("shop").send_batch([Message("orders", f"m{i}".encode()) for i in range(4)])
    broker.tick(clock.now_ms())
    wh = broker.warehouse
    got = positions(wh, ["billing"])
    assert set(got) == {QueueKey("billing", "", "orders", 0), QueueKey("billing", "", "orders", 1)}
    assert all(isinstance(p, Position) and p.next_offset == 2 and p.attempts == 0 for p in got.values())
    assert positions(wh, []) == {} and positions(wh, ["nobody"]) == {}
    assert not any(k.group.startswith("%") for k in positions(wh))  # job rows are not positions
    assert START.next_offset == 0 and START.suspend_until is None
    assert clients_with_offsets(wh, "billing", "orders") == {""} and not clients_with_offsets(
        wh, "billing", "other"
    )
    rows = progress(wh, {DISPATCH_GROUP: ("", "orders"), PROMOTE_GROUP: None})
    heads = {(r.topic, r.queue_id): r.next_offset for r in rows[DISPATCH_GROUP]}
    assert heads[("orders", 0)] == 2 and heads[("orders", 1)] == 2
    version = [r for r in rows[DISPATCH_GROUP] if r.queue_id == -1]
    assert len(version) == 1 and version[0].progress_version is not None and version[0].topic == ""
