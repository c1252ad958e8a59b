"""Views for SQL users: queue state counted the way a user counts it.

``commit_log`` stores the broker's own copies beside what producers sent (a delayed
message is stored again when it falls due, a committed transaction as its half and its
real message, a retry and a dead letter as copies under system topics), and every time is
epoch milliseconds. The views here answer the common questions directly:

- ``messages``: one row per message as a producer sent it (copies left out), its times
  as timestamps, and ``state``: where it is now (``stored``, ``delayed``, ``prepared``,
  ``rolled back``, ``discarded`` (a transaction check-back gave up on), ``visible``,
  ``expired`` (retention removed it from its queue; its stored rows go later, by day)).
- ``message_groups``: one row per sent message and consumer group subscribed to its
  topic, with the group's ``state`` of it: ``pending``, ``in flight`` (pulled, not
  acked), ``in retry``, ``dead-lettered``, ``consumed`` (acked, or the group's offset is past it:
  consumed, or passed over by its filter or because the group started later), or, while
  it is not visible, the message's own state.

Each view is one SQL text over the tables, built with ``name(table)`` for the name a
table goes by (a temp view of this session, or ``database.table`` in a catalog), so the
same definitions serve ``Broker.sql``, ``deltamq sql`` and :mod:`deltamq.register`.
"""

from __future__ import annotations

from collections.abc import Callable

from deltamq.constants import (
    ACKED,
    DLQ_PREFIX,
    ENDED,
    INFLIGHT,
    RETAIN_GROUP,
    RETRY_PREFIX,
    SYSTEM_TOPICS,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Prop,
    SysFlag,
)
from deltamq.tables.sqltext import sql_in, sql_str

Name = Callable[[str], str]
"""The name a table goes by in the statement (``commit_log`` → ``commit_log`` or
``mq.commit_log``)."""

_TX_BITS = 0xC  # sys_flag's transaction type bits
_SYSTEM_PROPS = (
    Prop.DELAY,
    Prop.REAL_TOPIC,
    Prop.REAL_QID,
    Prop.RETRY_TOPIC,
    Prop.ORIGIN_MESSAGE_ID,
    Prop.RECONSUME_TIME,
    Prop.MAX_RECONSUME_TIMES,
    Prop.TRAN_MSG,
    Prop.PGROUP,
    Prop.TRANSACTION_CHECK_TIMES,
    Prop.UNIQ_KEY,
    Prop.TIMER_DELIVER_MS,
    Prop.TRAN_ID,
    Prop.DLQ_REASON,
    Prop.LAST_ERROR,
    Prop.TRAN_STATE,
)


def _user_topic(column: str = "topic") -> str:
    n_retry, n_dlq = len(RETRY_PREFIX), len(DLQ_PREFIX)
    return (
        f"({column} NOT IN {sql_in(sorted(SYSTEM_TOPICS))} "
        f"AND substr({column}, 1, {n_retry}) <> {sql_str(RETRY_PREFIX)} "
        f"AND substr({column}, 1, {n_dlq}) <> {sql_str(DLQ_PREFIX)})"
    )


def _prop(key: str, alias: str = "") -> str:
    return f"{alias}properties[{sql_str(key)}]"


def _sent(name: Name) -> str:
    """The rows producers stored: a message's own id is its ``UNIQ_KEY``; the broker's
    copies carry the original's."""
    return f"SELECT * FROM {name('commit_log')} WHERE {_prop(Prop.UNIQ_KEY)} = msg_id AND {_user_topic()}"


def messages_sql(name: Name) -> str:
    prepared = SysFlag.TRANSACTION_PREPARED_TYPE
    # when it falls due (epoch ms): a timer's time, or its store time plus its level's delay
    due = f"coalesce(CAST({_prop(Prop.TIMER_DELIVER_MS, 's.')} AS BIGINT), s.store_ts + lv.delay_ms)"
    return (
        f"WITH sent AS ({_sent(name)}), "
        "ended AS ("
        f"SELECT {_prop(Prop.TRAN_ID)} AS tran_id, max({_prop(Prop.TRAN_STATE)}) AS tran_state "
        f"FROM {name('commit_log')} WHERE topic = {sql_str(TRANS_OP_HALF_TOPIC)} GROUP BY 1), "
        f"discarded AS (SELECT DISTINCT {_prop(Prop.TRAN_ID)} AS tran_id FROM {name('commit_log')} "
        f"WHERE topic = {sql_str(TRANS_CHECK_MAX_TIME_TOPIC)}), "
        # the latest cut a retention pass applied: an index row due before it was removed
        f"retained AS (SELECT max(next_offset) AS cut FROM {name('offsets')} "
        f"WHERE consumer_group = {sql_str(RETAIN_GROUP)} AND queue_id = -1), "
        "indexed AS ("
        f"SELECT {_prop(Prop.UNIQ_KEY)} AS id, min(store_ts) AS visible_ts "
        f"FROM {name('consume_queue')} WHERE {_user_topic()} GROUP BY 1) "
        "SELECT s.msg_id, s.topic, s.queue_id, s.tags, s.keys, s.body, s.producer_group, "
        f"map_filter(s.properties, (k, v) -> NOT k IN {sql_in(_SYSTEM_PROPS)}) AS properties, "
        "timestamp_millis(s.born_ts) AS born_at, timestamp_millis(s.store_ts) AS stored_at, "
        f"CAST({_prop(Prop.DELAY, 's.')} AS INT) AS delay_level, "
        f"timestamp_millis({due}) AS deliver_at, "
        # the first end counts (docs/behaviour.md §5): a message that became visible was
        # committed, whatever ended it later; else any rollback wins over a commit
        f"CASE WHEN s.sys_flag & {_TX_BITS} = {prepared} THEN CASE WHEN i.id IS NOT NULL THEN 'COMMIT' "
        "ELSE coalesce(e.tran_state, CASE WHEN x.tran_id IS NOT NULL THEN 'DISCARDED' ELSE 'PREPARED' END) "
        "END END AS transaction, "
        "CASE WHEN i.id IS NOT NULL THEN 'visible' "
        "WHEN e.tran_state = 'ROLLBACK' THEN 'rolled back' "
        "WHEN e.tran_state IS NULL AND x.tran_id IS NOT NULL THEN 'discarded' "
        f"WHEN s.sys_flag & {_TX_BITS} = {prepared} AND e.tran_state IS NULL THEN 'prepared' "
        # not in its queue and due before retention's cut: its index row was removed (a
        # row dispatch had not indexed yet would be removed as soon as it were)
        f"WHEN coalesce({due}, s.store_ts) < r.cut THEN 'expired' "
        f"WHEN {_prop(Prop.DELAY, 's.')} IS NOT NULL OR {_prop(Prop.TIMER_DELIVER_MS, 's.')} IS NOT NULL "
        "THEN 'delayed' ELSE 'stored' END AS state, "
        "timestamp_millis(i.visible_ts) AS visible_at, s.store_date "
        "FROM sent s "
        f"LEFT JOIN ended e ON e.tran_id = coalesce({_prop(Prop.TRAN_ID, 's.')}, s.msg_id) "
        f"LEFT JOIN discarded x ON x.tran_id = coalesce({_prop(Prop.TRAN_ID, 's.')}, s.msg_id) "
        "LEFT JOIN indexed i ON i.id = s.msg_id CROSS JOIN retained r "
        f"LEFT JOIN {name('schedule_levels')} lv ON lv.level = CAST({_prop(Prop.DELAY, 's.')} AS INT)"
    )


def message_groups_sql(name: Name) -> str:
    n_retry, n_dlq = len(RETRY_PREFIX), len(DLQ_PREFIX)
    uniq = _prop(Prop.UNIQ_KEY)
    return (
        f"WITH sent AS (SELECT msg_id, topic, state, store_date FROM {name('messages')}), "
        # where each group stands on each queue (a broadcast group: its slowest instance)
        "pos AS (SELECT consumer_group, topic, queue_id, min(next_offset) AS next_offset "
        f"FROM {name('offsets')} WHERE substr(consumer_group, 1, 1) <> '%' GROUP BY 1, 2, 3), "
        # the message's copies consumers read: in its topic, and in each group's retry topic
        f"copies AS (SELECT {uniq} AS id, topic, queue_id, queue_offset FROM {name('consume_queue')} "
        f"WHERE {uniq} IS NOT NULL AND topic NOT IN {sql_in(sorted(SYSTEM_TOPICS))} "
        f"AND substr(topic, 1, {n_dlq}) <> {sql_str(DLQ_PREFIX)}), "
        # sent back for a retry (each with a delay), and retry copies the group has read
        "retries AS (SELECT id, consumer_group, sum(sent_back) AS sent_back, sum(read) AS read FROM ("
        f"SELECT {uniq} AS id, substr(topic, {n_retry + 1}) AS consumer_group, 1 AS sent_back, 0 AS read "
        f"FROM {name('commit_log')} WHERE substr(topic, 1, {n_retry}) = {sql_str(RETRY_PREFIX)} "
        f"AND ({_prop(Prop.DELAY)} IS NOT NULL OR {_prop(Prop.TIMER_DELIVER_MS)} IS NOT NULL) "
        f"UNION ALL SELECT c.id, substr(c.topic, {n_retry + 1}), 0, "
        "CASE WHEN c.queue_offset < p.next_offset THEN 1 ELSE 0 END FROM copies c "
        f"JOIN pos p ON p.consumer_group = substr(c.topic, {n_retry + 1}) AND p.topic = c.topic "
        f"AND p.queue_id = c.queue_id WHERE substr(c.topic, 1, {n_retry}) = {sql_str(RETRY_PREFIX)}"
        ") GROUP BY 1, 2), "
        f"dead AS (SELECT DISTINCT {uniq} AS id, substr(topic, {n_dlq + 1}) AS consumer_group "
        f"FROM {name('commit_log')} WHERE substr(topic, 1, {n_dlq}) = {sql_str(DLQ_PREFIX)}), "
        # pulled and neither acked, nacked nor expired yet (the log's ending rows)
        "flying AS (SELECT DISTINCT d.consumer_group, d.topic, d.queue_id, d.queue_offset "
        f"FROM {name('deliveries')} d LEFT JOIN (SELECT DISTINCT receipt_handle FROM {name('deliveries')} "
        f"WHERE state IN {sql_in(ENDED)}) e ON e.receipt_handle = d.receipt_handle "
        f"WHERE d.state = {sql_str(INFLIGHT)} AND e.receipt_handle IS NULL), "
        # acked by a pull client: consumed, though the tick has not moved the offset yet (an
        # ack of a handout the log does not hold counts for nothing: pull_log.ENDS_ONLY)
        "acked AS (SELECT DISTINCT a.consumer_group, a.topic, a.queue_id, a.queue_offset "
        f"FROM {name('deliveries')} a JOIN (SELECT DISTINCT receipt_handle FROM {name('deliveries')} "
        f"WHERE state = {sql_str(INFLIGHT)}) h ON h.receipt_handle = a.receipt_handle "
        f"WHERE a.state = {sql_str(ACKED)}) "
        "SELECT s.msg_id, s.topic, g.consumer_group, "
        "CASE WHEN d.id IS NOT NULL THEN 'dead-lettered' "
        "WHEN r.sent_back > r.read THEN 'in retry' "
        "WHEN c.id IS NULL THEN s.state "
        "WHEN f.queue_offset IS NOT NULL THEN 'in flight' "
        "WHEN p.next_offset IS NOT NULL AND c.queue_offset < p.next_offset THEN 'consumed' "
        "WHEN a.queue_offset IS NOT NULL THEN 'consumed' "
        "ELSE 'pending' END AS state, "
        "coalesce(r.sent_back, 0) AS retries, c.queue_id, c.queue_offset, s.store_date "
        "FROM sent s "
        f"JOIN (SELECT DISTINCT consumer_group, topic FROM {name('subscription')}) g ON g.topic = s.topic "
        "LEFT JOIN copies c ON c.id = s.msg_id AND c.topic = s.topic "
        "LEFT JOIN pos p ON p.consumer_group = g.consumer_group AND p.topic = c.topic "
        "AND p.queue_id = c.queue_id "
        "LEFT JOIN retries r ON r.id = s.msg_id AND r.consumer_group = g.consumer_group "
        "LEFT JOIN dead d ON d.id = s.msg_id AND d.consumer_group = g.consumer_group "
        "LEFT JOIN flying f ON f.consumer_group = g.consumer_group AND f.topic = c.topic "
        "AND f.queue_id = c.queue_id AND f.queue_offset = c.queue_offset "
        "LEFT JOIN acked a ON a.consumer_group = g.consumer_group AND a.topic = c.topic "
        "AND a.queue_id = c.queue_id AND a.queue_offset = c.queue_offset"
    )


VIEWS: dict[str, Callable[[Name], str]] = {"messages": messages_sql, "message_groups": message_groups_sql}
"""Each view's name and its SQL text, in the order they are created."""

USES: dict[str, tuple[str, ...]] = {
    "messages": ("commit_log", "consume_queue", "schedule_levels", "offsets"),
    "message_groups": ("messages", "offsets", "consume_queue", "commit_log", "subscription", "deliveries"),
}
"""The tables and views each view reads."""


def needed(names: set[str]) -> set[str]:
    """``names`` and everything the views among them read, transitively."""
    out = set(names)
    todo = [n for n in names if n in USES]
    while todo:
        for used in USES[todo.pop()]:
            if used not in out:
                out.add(used)
                todo += [used] if used in USES else []
    return out
