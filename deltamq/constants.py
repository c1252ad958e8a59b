"""Names shared with RocketMQ: system topics, property keys, statuses, flags.

The values are RocketMQ's own spellings (docs/behaviour.md §1) so that SQL users and RocketMQ
users recognise them in the tables.
"""

from __future__ import annotations

import re
from enum import StrEnum

SCHEMA_VERSION = 7
"""The warehouse schema version this release writes. 7: ``queue_lock`` is partitioned by
(group, topic, queue), so lock writes of different queues do not conflict (the upgrade
rewrites the table's few rows in that layout). 6: copies promoted ahead are in the
index before they are due (their ``due_ts`` says when; a release before 6 would hand them
out early, so it refuses the warehouse). 5: ``leases.ttl_ms``."""

# --- system topics -------------------------------------------------------------
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
TRANS_HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
TRANS_OP_HALF_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
TRANS_CHECK_MAX_TIME_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
# RocketMQ 5 keeps its timer wheel in rmq_sys_wheel_timer; ours is an index by due time.
TIMER_TOPIC = "rmq_sys_wheel_timer"
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"

SYSTEM_TOPICS = frozenset(
    {SCHEDULE_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC, TIMER_TOPIC}
)
SYSTEM_TOPIC_PREFIXES = (RETRY_PREFIX, DLQ_PREFIX)

RESEND_PRODUCER_GROUP = "DLQ_RESEND"
"""The producer group of dead letters resent to their topic (``dlq resend``): retention
keeps these rows as long as dead letters, so a resend stays recognised as done."""

ENDS_LOOKBACK_MS = 10 * 60_000
"""Dispatch looks for a transaction's ends already indexed from this long before the
transaction started: an op record's batch id carries the clock of whoever ended the
transaction (another producer instance, or the tick's check pass), which may be behind
the clock that stored the half."""

CLOCK_CORRECTION_SLACK_MS = 60_000
"""Clock correction (docs/behaviour.md §2) takes a delay-level entry as due now when its
due time is later than the pass's ``now`` plus its level's delay plus this much: a
message stored while the tick in progress runs (after its ``now``, by milliseconds to
seconds), or by a producer whose clock is less than this ahead, keeps its delay."""


def retry_topic(group: str) -> str:
    """The retry topic of a consumer group (``%RETRY%<group>``)."""
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    """The dead-letter topic of a consumer group (``%DLQ%<group>``)."""
    return DLQ_PREFIX + group


def is_system_topic(topic: str) -> bool:
    """True for topics only the engine may write (docs/behaviour.md §1)."""
    return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIXES)


# --- names ---------------------------------------------------------------------
TOPIC_PATTERN = re.compile(r"^[%|a-zA-Z0-9_-]+$")
TOPIC_MAX_LENGTH = 127
# Group names become part of %RETRY%<group>, so they obey the topic rule minus the prefix.
GROUP_PATTERN = re.compile(r"^[a-zA-Z0-9_-]+$")
GROUP_MAX_LENGTH = TOPIC_MAX_LENGTH - len(RETRY_PREFIX)

# --- message limits ------------------------------------------------------------
MAX_BODY_BYTES = 4 * 1024 * 1024
# states of the pull deliveries log (docs/behaviour.md §6; deltamq/tables/deliveries.py)
INFLIGHT, PASSED, TAKEN = "INFLIGHT", "PASSED", "TAKEN"
ACKED, NACKED, EXPIRED, REVOKED = "ACKED", "NACKED", "EXPIRED", "REVOKED"
ENDED = (ACKED, NACKED, EXPIRED, REVOKED)
"""States that end an INFLIGHT row of the same receipt handle."""
NACK_REQUESTED = "NACK_REQUESTED"
"""A nack by a client without an engine (deltamq.lite.PullConsumer): its ``invisible_until``
holds the requested delay level; the tick's pull_expiry sends the delivery back at that
level and ends it NACKED. Until then the delivery is in flight (an ack still ends it)."""

DEFAULT_QUEUES = 4
MAX_QUEUES = 1024
DEFAULT_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"


class Prop:
    """System property keys (docs/behaviour.md §1). Use these, never string literals."""

    DELAY = "DELAY"
    REAL_TOPIC = "REAL_TOPIC"
    REAL_QID = "REAL_QID"
    RETRY_TOPIC = "RETRY_TOPIC"
    ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
    RECONSUME_TIME = "RECONSUME_TIME"
    MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
    TRAN_MSG = "TRAN_MSG"
    PGROUP = "PGROUP"
    TRANSACTION_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
    CHECK_IMMUNITY_TIME_IN_SECONDS = "CHECK_IMMUNITY_TIME_IN_SECONDS"
    UNIQ_KEY = "UNIQ_KEY"
    TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
    TRAN_ID = "TRAN_ID"
    DLQ_REASON = "DLQ_REASON"
    # our extension: the listener's exception text (or bad return) of the failed delivery
    LAST_ERROR = "LAST_ERROR"
    # our extension: on an op record, how the transaction ended (COMMIT or ROLLBACK)
    TRAN_STATE = "TRAN_STATE"
    # our extension: on a message resent from a DLQ, the dead letter's msg id
    RESENT_FROM = "RESENT_FROM"


class SysFlag:
    """``sys_flag`` bits, as in RocketMQ's MessageSysFlag."""

    TRANSACTION_NOT_TYPE = 0
    TRANSACTION_PREPARED_TYPE = 0x1 << 2
    TRANSACTION_COMMIT_TYPE = 0x2 << 2
    TRANSACTION_ROLLBACK_TYPE = 0x3 << 2


class Perm(StrEnum):
    """Topic permissions: readable and/or writable, as RocketMQ's PermName."""

    RW = "RW"
    R = "R"
    W = "W"
    DENY = "DENY"

    @property
    def writable(self) -> bool:
        return self in (Perm.RW, Perm.W)

    @property
    def readable(self) -> bool:
        return self in (Perm.RW, Perm.R)


# Internal system "groups" that keep job progress in the offsets table.
DISPATCH_GROUP = "%DISPATCH%"
PROMOTE_GROUP = "%PROMOTE%"
TRANSACTION_GROUP = "%TRANSACTION%"
RETAIN_GROUP = "%RETAIN%"
# Tag of op records (RocketMQ's TransactionalMessageUtil.REMOVE_TAG).
OP_TAG = "d"


# RocketMQ's LocalTransactionState spellings, accepted for ours
TX_ALIASES = {"COMMIT_MESSAGE": "COMMIT", "ROLLBACK_MESSAGE": "ROLLBACK", "UNKNOW": "UNKNOWN"}


class FailReason(StrEnum):
    """Why a delivery ended unconsumed, when not by the listener's own answer (a failed
    delivery whose listener answered RECONSUME_LATER has no reason)."""

    POISON = "poison"  # the listener's process died on it, every try
    TIMEOUT = "timeout"  # it ran past consume_timeout_ms and was killed
    SETUP = "setup"  # the listener could not be loaded: nothing was handed over
    SUSPEND = "suspend"  # orderly: SUSPEND_CURRENT_QUEUE_A_MOMENT (the chunk waits)
    NOT_DELIVERED = "not_delivered"  # orderly: behind a suspended chunk in its queue
    ORDERLY_MAX = "orderly_max"  # orderly: suspended max_reconsume_times already
    LATER_COPY = "later_copy"  # de-duplication: a later copy of a key taken in the same pass
    DEFERRED = "deferred"  # not handed over: its listener timed out earlier in the pass


NOT_HANDED_OVER = (FailReason.DEFERRED, FailReason.NOT_DELIVERED)
"""Reasons of messages that never reached the listener in a pass (they wait for the next)."""


class DlqReason(StrEnum):
    """Why a message went to its group's ``%DLQ%`` topic (its ``DLQ_REASON`` property)."""

    POISON = "poison"
    TIMEOUT = "timeout"
    ORDERLY_MAX = "orderly_max"
    NEGATIVE_LEVEL = "negative_level"  # the listener asked for a delay level below 0
    MAX_RECONSUME = "max_reconsume"  # retried max_reconsume_times already


class TxState(StrEnum):
    """How a local transaction ended (RocketMQ's LocalTransactionState)."""

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def of(cls, value: object) -> TxState:
        """A listener's answer as a state; RocketMQ's spellings (``COMMIT_MESSAGE``,
        ``ROLLBACK_MESSAGE``, ``UNKNOW``) are accepted. Anything else raises ValueError."""
        if isinstance(value, TxState):
            return value
        text = getattr(value, "name", value)
        if isinstance(text, str):
            key = text.strip().upper()
            key = {"COMMIT_MESSAGE": "COMMIT", "ROLLBACK_MESSAGE": "ROLLBACK", "UNKNOW": "UNKNOWN"}.get(
                key, key
            )
            if key in cls.__members__:
                return cls[key]
        raise ValueError(f"{value!r} is not a transaction state; allowed: COMMIT, ROLLBACK, UNKNOWN")


# --- the jobs ---------------------------------------------------------------------------------
# A tick's steps in docs/design.md's order, each with the lease (job kind) it runs under:
# dispatch → deliver → pull deliveries' expiry → promote (what falls due by now plus
# promote_ahead_ms) → dispatch again (if promote wrote copies it did not index) → deliver
# again (if promote's copies were due already) → sink → check_transactions → retain
# (hourly: it skips itself in between). Deliver comes before promote so that copies
# promoted ahead by the last tick reach their listeners first. The tick runner, the
# CLI's ``deltamq job`` and the Airflow DAGs all read this one list.
JOB_STEPS: tuple[tuple[str, str], ...] = (
    ("dispatch", "dispatch"),
    ("deliver", "deliver"),
    ("pull_expiry", "deliver"),
    ("promote", "promote"),
    ("redispatch", "dispatch"),
    ("redeliver", "deliver"),
    ("sink", "sink"),
    ("check_transactions", "check_transactions"),
    ("retain", "retain"),
)
JOB_NAMES: tuple[str, ...] = tuple(dict.fromkeys(lease for _, lease in JOB_STEPS))
"""The job kinds (one lease each), in order."""

MAX_ERROR_CHARS = 4096

SETUP_FAILED_EXIT = 4
"""Exit status of a tick or job (``deltamq tick``, ``deltamq job``, the spark-submit entry)
that ran, but in which a push group or a sink consumed nothing: its listener or transform
could not be loaded where it runs, or the sink's pass failed on its rows. Its messages wait."""
"""The longest error text kept (a listener's error in ``LAST_ERROR``, a tick's in ``job_runs``)."""

COMMIT_LOG_GROUPS = ("topic", "queue_id")
"""The columns by which deltamq's own writers group a large ``commit_log`` file's rows into
row groups (deltamq/delta_append.py): a pull client of a few queues decodes only theirs."""
