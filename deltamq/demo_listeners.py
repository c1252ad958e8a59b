"""Listeners of ``deltamq demo`` (light imports: they run in listener worker processes).

Each writes what it decided to the JSON-lines file named by ``DELTAMQ_DEMO_LOG`` so the
demo can tell the story.
"""

from __future__ import annotations

import json
import os

from deltamq.consumer import ConsumeStatus

PAID = {"order-2"}


def _log(**fields) -> None:
    with open(os.environ["DELTAMQ_DEMO_LOG"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(fields) + "\n")


def billing(messages, context):
    for m in messages:
        _log(group="billing", order=m.keys, action=f"booked '{m.tags}'", reconsume=m.reconsume_times)
    return ConsumeStatus.CONSUME_SUCCESS


def cancel_unpaid(messages, context):
    for m in messages:
        order = json.loads(m.body)["order"]
        if order in PAID:
            _log(
                group="order-canceller",
                order=order,
                action="paid in time: nothing to cancel",
                reconsume=m.reconsume_times,
            )
        elif order == "order-3" and m.reconsume_times == 0:
            _log(
                group="order-canceller",
                order=order,
                action="inventory service unavailable: RECONSUME_LATER",
                reconsume=m.reconsume_times,
            )
            return ConsumeStatus.RECONSUME_LATER
        else:
            _log(
                group="order-canceller",
                order=order,
                action="unpaid after 30 min: cancelled",
                reconsume=m.reconsume_times,
            )
    return ConsumeStatus.CONSUME_SUCCESS
