"""Trivial listeners for bench_deliver.py (importable by the listener workers)."""

from deltamq.consumer import ConsumeStatus


def ok(messages, context):
    return ConsumeStatus.CONSUME_SUCCESS


def fail_ten_percent(messages, context):
    """Fails one call in ten (chunk number ending in 7, counted by the first message's
    offset): 10 % of the messages with one per call, ~10 % of the chunks with 32."""
    if (messages[0].queue_offset // len(messages)) % 10 == 7:
        return ConsumeStatus.RECONSUME_LATER
    return ConsumeStatus.CONSUME_SUCCESS
