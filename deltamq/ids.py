"""Message ids, batch ids and store dates, in Python and as Spark expressions.

A producer commit gets one ``batch_id = (store_ms << 20) | 0x80000 | random 19 bits``;
a row's ``msg_id`` is the 16 hex digits of its batch id followed by 8 hex digits of
its position in the batch. Ids therefore sort by store time (so an id range prunes
Delta files) and are a pure function of (batch, position).

Rows the engine writes get ids derived from their inputs: ``batch_id = (store_ms <<
20) | kind`` with ``kind`` below 0x80000 (so never a producer's), and a position from
the source (e.g. a promoted message: store time = its due time, kind = its delay
level or the timer kind, position = the schedule entry's queue offset).
"""

from __future__ import annotations

import secrets
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column

BATCH_RANDOM_BITS = 20
DAY_MS = 86_400_000


PRODUCER_BIT = 1 << (BATCH_RANDOM_BITS - 1)
KIND_TIMER = 0x1000  # engine kinds: 1..N schedule levels, timers, sends-back
KIND_RETRY = 0x2000
KIND_DLQ = 0x3000
# transaction check-back (position = the half queue offset of the entry handled)
KIND_TXN_HALF = 0x4000  # a half message written again at the end of the half queue
KIND_TXN_COMMIT = 0x4001  # the real message of a committed transaction
KIND_TXN_OP = 0x4002  # an op record
KIND_TXN_DISCARD = 0x4003  # a half message moved to TRANS_CHECK_MAX_TIME_TOPIC


MSG_ID_PATTERN = "^[0-9A-F]{24}([0-9A-F]{8})?$"


def parse_msg_id(msg_id: str) -> tuple[int, int]:
    """(batch id, position) of an id made by :func:`msg_id` (24 or 32 hex digits);
    ValueError naming the rule otherwise."""
    if (
        not isinstance(msg_id, str)
        or len(msg_id) not in (24, 32)
        or any(c not in "0123456789ABCDEF" for c in msg_id)
    ):
        raise ValueError(f"{msg_id!r} is not a deltamq message id (24 or 32 upper-case hex digits)")
    return int(msg_id[:16], 16), int(msg_id[16:], 16)


def new_batch_id(store_ms: int) -> int:
    """A fresh batch id for a producer commit stored at ``store_ms``."""
    return (store_ms << BATCH_RANDOM_BITS) | PRODUCER_BIT | secrets.randbits(BATCH_RANDOM_BITS - 1)


def engine_batch_id(store_ms: int, kind: int) -> int:
    """A batch id for an engine-written row: a function of its inputs only."""
    if not 0 <= kind < PRODUCER_BIT:
        raise ValueError(f"engine kind {kind} must be in 0..{PRODUCER_BIT - 1}")
    return (store_ms << BATCH_RANDOM_BITS) | kind


def engine_batch_id_col(store_ms: Column, kind: Column) -> Column:
    """Spark expression equal to :func:`engine_batch_id`."""
    from pyspark.sql import functions as F

    return F.shiftleft(store_ms.cast("bigint"), BATCH_RANDOM_BITS).bitwiseOR(kind.cast("bigint"))


POS_8_DIGITS = 1 << 32


def msg_id(batch_id: int, pos: int) -> str:
    """``%016X%08X`` of (batch id, position); a position of 2^32 or more takes 16 hex
    digits (never truncated: two positions never share an id)."""
    return f"{batch_id:016X}{pos:08X}" if pos < POS_8_DIGITS else f"{batch_id:016X}{pos:016X}"


def msg_ids(batch_id: int, n: int) -> list[str]:
    """:func:`msg_id` of positions 0 … n−1 of one batch."""
    head = f"{batch_id:016X}"
    if n <= POS_8_DIGITS:
        return [f"{head}{pos:08X}" for pos in range(n)]
    return [msg_id(batch_id, pos) for pos in range(n)]


def msg_id_array(batch_id: int, n: int) -> pa.Array:
    """:func:`msg_ids` as an Arrow string array, built with numpy (the same text: 16 hex
    digits of the batch, 8 of the position; a columnar send's ids without a Python string
    each)."""
    import numpy as np
    import pyarrow as pa

    width = 24
    if width * (n + 1) >= 1 << 31:  # beyond 32-bit string offsets
        return pa.array(msg_ids(batch_id, n), pa.string())
    hex_digits = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
    chars = np.empty((n, width), dtype=np.uint8)
    chars[:, :16] = np.frombuffer(f"{batch_id:016X}".encode(), dtype=np.uint8)
    pos = np.arange(n, dtype=np.uint64)
    for i in range(8):
        chars[:, 16 + i] = hex_digits[(pos >> np.uint64(4 * (7 - i))) & np.uint64(0xF)]
    offsets = pa.py_buffer(np.arange(0, width * (n + 1), width, dtype=np.int32).tobytes())
    return pa.StringArray.from_buffers(n, offsets, pa.py_buffer(chars.tobytes()))


def msg_id_col(batch_id: Column, pos: Column) -> Column:
    """Spark expression equal to :func:`msg_id` (``hex`` of a BIGINT is upper case;
    ``lpad`` truncates, so the width follows the value)."""
    from pyspark.sql import functions as F

    width = F.when(pos < F.lit(POS_8_DIGITS), F.lit(8)).otherwise(F.lit(16))
    return F.concat(F.lpad(F.hex(batch_id), 16, "0"), F.lpad(F.hex(pos), width, "0"))


def store_date(ms: int) -> date:
    """UTC date of epoch ms (the commit_log partition)."""
    return datetime.fromtimestamp(ms // 1000, tz=UTC).date()


def store_date_col(ms: Column) -> Column:
    """Spark expression equal to :func:`store_date`, independent of the session time zone."""
    from pyspark.sql import functions as F

    return F.date_from_unix_date(F.floor(ms / F.lit(DAY_MS)).cast("int"))
