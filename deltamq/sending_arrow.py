"""A columnar send: the commit_log rows of an Arrow table of messages, built a column at a
time (``BaseProducer.send_arrow``). The same rules as a send of ``Message`` objects
(deltamq/sending.py) and as ``send_dataframe``, checked over whole columns: no Python
object per message, so a bulk load of a million messages costs about what writing its
Parquet file does (bench/README.md). Imports nothing from PySpark.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deltamq import ids
from deltamq.constants import Prop, SysFlag
from deltamq.errors import BodyTooLarge, InvalidMessage

ALLOWED = ("topic", "body", "tags", "keys", "flag", "queue_id")
"""The columns ``send_arrow`` takes (``topic`` and ``body`` required)."""
_TEXT = (pa.string(), pa.large_string())
_INTS = (pa.int8(), pa.int16(), pa.int32(), pa.int64())
_BINARY = (pa.binary(), pa.large_binary(), *_TEXT)


@dataclass(frozen=True)
class ArrowBatch:
    """A checked table of messages: its columns as stored, one topic name per row."""

    topic: pa.Array
    body: pa.ChunkedArray
    tags: pa.ChunkedArray
    keys: pa.ChunkedArray
    flag: pa.ChunkedArray
    queue_id: pa.Array | None  # given by the caller (ids, or keys), checked against the topics' queues


def check(table: object, queue_key: str | None, max_body_bytes: int) -> ArrowBatch:
    """``table``'s messages checked (InvalidMessage or BodyTooLarge naming the row and
    the rule); nothing is stored before every row passed."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise InvalidMessage(
            f"send_arrow takes a pyarrow Table or RecordBatch, got {type(table).__name__} "
            "(a pandas DataFrame: pyarrow.Table.from_pandas(df, preserve_index=False))"
        )
    extra = sorted(set(table.column_names) - set(ALLOWED) - {queue_key})
    if extra:
        raise InvalidMessage(
            f"send_arrow: column(s) {extra} are not message fields; allowed: {', '.join(ALLOWED)} "
            "(and the queue_key column). Properties, delays and timers: send_batch or send_dataframe"
        )
    for required in ("topic", "body"):
        if required not in table.column_names:
            raise InvalidMessage(f"send_arrow: the table needs a {required!r} column")
    if queue_key is not None and queue_key not in table.column_names:
        raise InvalidMessage(f"send_arrow: queue_key={queue_key!r} names no column of the table")
    if queue_key is not None and "queue_id" in table.column_names:
        raise InvalidMessage("send_arrow: give queue_id or queue_key, not both")
    n = table.num_rows
    topic = _typed(table, "topic", _TEXT, nulls=False).cast(pa.string()).combine_chunks()
    body = _typed(table, "body", _BINARY, nulls=False).cast(pa.binary())
    sizes = pc.binary_length(body)
    if n and pc.max(sizes).as_py() > max_body_bytes:
        row = pc.index(pc.greater(sizes, max_body_bytes), True).as_py()
        raise BodyTooLarge(
            f"send_arrow: row {row}'s body is {sizes[row].as_py()} bytes; at most {max_body_bytes} bytes "
            "are allowed"
        )
    tags, keys = (_optional(table, c, _TEXT, pa.string(), n) for c in ("tags", "keys"))
    flag = _optional(table, "flag", _INTS, pa.int32(), n)
    queue_id: pa.Array | None = None
    if "queue_id" in table.column_names:
        queue_id = _typed(table, "queue_id", _INTS, nulls=False)
        queue_id = queue_id.cast(pa.int32()).combine_chunks()
    if queue_key is not None:  # strings: each row's queue comes from its key (queues_of)
        queue_id = _typed(table, queue_key, _TEXT, nulls=True).cast(pa.string()).combine_chunks()
    return ArrowBatch(topic, body, tags, keys, flag.fill_null(0), queue_id)


def _column(table: pa.Table, name: str) -> pa.ChunkedArray:
    """A column as given: not combined into one array (a copy of every body)."""
    return table.column(name)


def _typed(table: pa.Table, name: str, types: tuple[pa.DataType, ...], *, nulls: bool) -> pa.ChunkedArray:
    col = _column(table, name)
    if col.type not in types:
        raise InvalidMessage(
            f"send_arrow: column {name!r} is {col.type}; allowed: {', '.join(map(str, dict.fromkeys(types)))}"
        )
    if not nulls and col.null_count:
        row = pc.index(pc.is_null(col), True).as_py()
        raise InvalidMessage(f"send_arrow: row {row} has no {name} (null); every message needs one")
    return col


def _optional(
    table: pa.Table, name: str, types: tuple[pa.DataType, ...], to: pa.DataType, n: int
) -> pa.ChunkedArray:
    if name not in table.column_names:
        return pa.chunked_array([pa.nulls(n, to)])
    try:
        return _typed(table, name, types, nulls=True).cast(to)
    except pa.ArrowInvalid as e:  # a flag beyond 32 bits
        raise InvalidMessage(f"send_arrow: column {name!r}: {e}") from e


def queues_of(
    batch: ArrowBatch,
    topics: Mapping[str, int],
    next_start: Callable[[str, int, int], int],
    key_queue: Callable[[str, int], int],
) -> pa.Array:
    """Each row's queue: the caller's ``queue_id`` (checked against its topic's
    ``topics[topic]`` queues), its queue key's queue (``key_queue``), or else each topic's
    rows spread over its queues in equal runs of consecutive rows, from the queue
    ``next_start(topic, queues, rows)`` gives (the producer's round-robin, moved on by
    the rows sent). Runs keep a file's rows grouped by queue, which readers of one queue
    skip by."""
    n = len(batch.topic)
    out = np.zeros(n, dtype=np.int32)
    names = batch.topic.dictionary_encode()
    codes = names.indices.to_numpy(zero_copy_only=False)
    given = batch.queue_id
    keyed = given is not None and pa.types.is_string(given.type)
    for code, topic in enumerate(names.dictionary.to_pylist()):
        rows = np.nonzero(codes == code)[0]
        queues = topics[topic]
        if given is None:
            out[rows] = _runs_of(len(rows), queues, next_start(topic, queues, len(rows)))
            continue
        if keyed:
            keys = given.take(rows).to_pylist()
            if None in keys:
                raise InvalidMessage(f"send_arrow: row {int(rows[keys.index(None)])} has no queue key (null)")
            out[rows] = [key_queue(k, queues) for k in keys]
            continue
        picked = given.take(rows).to_numpy()
        bad = np.nonzero((picked < 0) | (picked >= queues))[0]
        if len(bad):
            row, asked = int(rows[bad[0]]), int(picked[bad[0]])
            raise InvalidMessage(
                f"send_arrow: row {row} asks for queue {asked} of topic {topic!r}; allowed 0..{queues - 1}"
            )
        out[rows] = picked
    return pa.array(out, pa.int32())


def _runs_of(m: int, queues: int, start: int) -> np.ndarray:
    """``m`` rows over ``queues`` queues in runs of consecutive rows, in queue order (a
    file's rows need no sort to be grouped by queue): each queue gets ``m // queues``, and
    the remainder goes one each to the queues from ``start`` on (the round-robin)."""
    base, extra = divmod(m, queues)
    sizes = np.full(queues, base)
    sizes[(start + np.arange(extra)) % queues] += 1
    return np.repeat(np.arange(queues, dtype=np.int32), sizes)


def rows(
    batch: ArrowBatch, queue_ids: pa.Array, schema: pa.Schema, now: int, producer_group: str
) -> tuple[pa.Table, pa.Array]:
    """The commit_log rows of ``batch`` under one fresh producer batch id, and their msg
    ids (row ``pos`` gets ``msg_id(batch, pos)``, as every send does)."""
    n = len(batch.topic)
    batch_id = ids.new_batch_id(now)
    mids = ids.msg_id_array(batch_id, n)
    properties = pa.MapArray.from_arrays(
        pa.array(np.arange(n + 1, dtype=np.int32)), pa.repeat(pa.scalar(Prop.UNIQ_KEY), n), mids
    )

    def const(value: object, typ: pa.DataType) -> pa.Array:
        return pa.repeat(pa.scalar(value, typ), n)

    columns = {
        "msg_id": mids,
        "topic": batch.topic,
        "queue_id": queue_ids,
        "tags": batch.tags,
        "keys": batch.keys,
        "body": batch.body,
        "flag": batch.flag,
        "properties": properties,
        "born_ts": const(now, pa.int64()),
        "store_ts": const(now, pa.int64()),
        "reconsume_times": const(0, pa.int32()),
        "sys_flag": const(int(SysFlag.TRANSACTION_NOT_TYPE), pa.int32()),
        "producer_group": const(producer_group, pa.string()),
        "batch_id": const(batch_id, pa.int64()),
        "batch_pos": pa.array(np.arange(n, dtype=np.int64)),
        "store_date": const(ids.store_date(now), pa.date32()),
    }
    return pa.table(columns, schema=schema), mids
