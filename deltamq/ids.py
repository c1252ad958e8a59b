"""Message ids, batch ids and store dates, in Python and as Spark expressions.

A producer commit gets one ``batch_id = (store_ms << 20) | random 20 bits``; a row's
``msg_id`` is the 16 hex digits of its batch id followed by 8 hex digits of its
position in the batch. Ids therefore sort by store time (so an id range prunes
Delta files) and are a pure function of (batch, position): ids of rows the engine
writes are derived from their inputs by choosing the batch id from them.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, date, datetime

from pyspark.sql import Column
from pyspark.sql import functions as F

BATCH_RANDOM_BITS = 20
DAY_MS = 86_400_000


def new_batch_id(store_ms: int) -> int:
    """A fresh batch id for a producer commit stored at ``store_ms``."""
    return (store_ms << BATCH_RANDOM_BITS) | secrets.randbits(BATCH_RANDOM_BITS)


def derived_batch_id(store_ms: int, *parts: str) -> int:
    """A batch id that is a function of its inputs (engine-written rows)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return (store_ms << BATCH_RANDOM_BITS) | (int.from_bytes(digest, "big") & ((1 << BATCH_RANDOM_BITS) - 1))


def batch_store_ms(batch_id: int) -> int:
    return batch_id >> BATCH_RANDOM_BITS


def msg_id(batch_id: int, pos: int) -> str:
    """``%016X%08X`` of (batch id, position)."""
    return f"{batch_id:016X}{pos:08X}"


def msg_id_col(batch_id: Column, pos: Column) -> Column:
    """Spark expression equal to :func:`msg_id` (``hex`` of a BIGINT is upper case)."""
    return F.concat(F.lpad(F.hex(batch_id), 16, "0"), F.lpad(F.hex(pos), 8, "0"))


def store_date(ms: int) -> date:
    """UTC date of epoch ms (the commit_log partition)."""
    return datetime.fromtimestamp(ms // 1000, tz=UTC).date()


def store_date_col(ms: Column) -> Column:
    """Spark expression equal to :func:`store_date`, independent of the session time zone."""
    return F.date_from_unix_date(F.floor(ms / F.lit(DAY_MS)).cast("int"))
