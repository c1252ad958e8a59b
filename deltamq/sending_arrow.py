"""A columnar send: the commit_log rows of an Arrow table of messages, built a column at a
time (``BaseProducer.send_arrow``). The same rules as a send of ``Message`` objects
(deltamq/sending.py) and as ``send_dataframe``, checked over whole columns: no Python
object per message, so a bulk load of a million messages costs about what writing its
Parquet file does (bench/README.md). Imports nothing from PySpark.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deltamq import ids
from deltamq.constants import Prop, SysFlag
from deltamq.errors import BodyTooLarge, InvalidDelayLevel, InvalidMessage, InvalidProperties, InvalidTimer
from deltamq.message import check_timer_horizon

log = logging.getLogger(__name__)

ALLOWED = ("topic", "body", "tags", "keys", "flag", "queue_id", "properties", "delay_level", "deliver_at_ms")
"""The columns ``send_arrow`` takes (``topic`` and ``body`` required)."""
_TEXT = (pa.string(), pa.large_string())
_INTS = (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64())
_BINARY = (pa.binary(), pa.large_binary(), *_TEXT)
_PROPERTIES = pa.map_(pa.string(), pa.string())
_ENTRIES = pa.list_(pa.struct([pa.field("key", pa.string(), nullable=False), pa.field("value", pa.string())]))
_TIMER_TEXT = "^[0-9]{1,18}$"
_SET_BY_THE_SEND = (Prop.UNIQ_KEY, Prop.TIMER_DELIVER_MS)
"""Property names whose given values the send replaces (the id; the timer, normalised)."""


@dataclass(frozen=True)
class Entries:
    """The checked (name, value) entries of every row's properties, and each one's row."""

    names: pa.Array
    values: pa.Array
    row: np.ndarray


@dataclass(frozen=True)
class ArrowBatch:
    """A checked table of messages: its columns as stored, one topic name per row."""

    topic: pa.Array
    body: pa.ChunkedArray
    tags: pa.ChunkedArray
    keys: pa.ChunkedArray
    flag: pa.ChunkedArray
    queue_id: pa.Array | None  # given by the caller (ids, or keys), checked against the topics' queues
    properties: Entries | None = None  # the caller's, checked
    delay_level: np.ndarray | None = None  # as asked (0: none), clamped when stored
    due: pa.Array | None = None  # a timer's due time, epoch ms (deliver_at_ms or TIMER_DELIVER_MS)


def check(table: object, queue_key: str | None, max_body_bytes: int, now: int, horizon_ms: int) -> ArrowBatch:
    """``table``'s messages checked (InvalidMessage or one of its kinds, naming the row and
    the rule; timers against ``now`` ± ``horizon_ms``); nothing is stored before every row
    passed."""
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
            "(and the queue_key column)"
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
        queue_id = _int(_typed(table, "queue_id", _INTS, nulls=False), "queue_id", pa.int32())
    if queue_key is not None:  # strings: each row's queue comes from its key (queues_of)
        queue_id = _typed(table, queue_key, _TEXT, nulls=True).cast(pa.string()).combine_chunks()
    properties = _properties(table) if "properties" in table.column_names else None
    level = _levels(table) if "delay_level" in table.column_names else None
    due = _due(table, properties, level, now, horizon_ms)
    return ArrowBatch(topic, body, tags, keys, flag.fill_null(0), queue_id, properties, level, due)


def _properties(table: pa.Table) -> Entries:
    """The ``properties`` column (string to string maps) checked as a send checks a
    message's: names non-empty, values not null, no ``DELAY`` (the delay level's)."""
    col = _column(table, "properties")
    if not (pa.types.is_map(col.type) and col.type.key_type in _TEXT and col.type.item_type in _TEXT):
        raise InvalidProperties(
            f"send_arrow: column 'properties' is {col.type}; allowed: map<string, string>"
        )
    props = col.cast(_PROPERTIES).combine_chunks()
    entries, parent = _entries(props)
    names, values = entries.field("key"), entries.field("value")

    def first(mask: pa.Array) -> tuple[int, str] | None:
        if not pc.any(mask).as_py():
            return None
        i = pc.index(mask, True).as_py()
        return int(parent[i]), names[i].as_py()

    if (bad := first(pc.equal(pc.binary_length(names), 0))) is not None:
        raise InvalidProperties(
            f"send_arrow: row {bad[0]} has a property named '': names are non-empty strings"
        )
    if (bad := first(pc.is_null(values))) is not None:
        raise InvalidProperties(
            f"send_arrow: row {bad[0]}'s property {bad[1]!r} is null; values must be strings"
        )
    several = np.bincount(parent)[parent] > 1 if len(parent) else np.zeros(0, dtype=bool)
    pairs = pa.table({"row": parent[several], "name": names.filter(pa.array(several))})
    twice = pairs.group_by(["row", "name"], use_threads=False).aggregate([("name", "count")])
    twice = twice.filter(pc.field("name_count") > 1)
    if twice.num_rows:  # a mapping holds a name once (readers of the stored map disagree)
        row = pc.min(twice.column("row")).as_py()
        name = twice.filter(pc.field("row") == row).column("name")[0].as_py()
        raise InvalidProperties(f"send_arrow: row {row} has property {name!r} twice; names are unique")
    if (bad := first(pc.equal(names, Prop.DELAY))) is not None:
        raise InvalidProperties(
            f"send_arrow: row {bad[0]} has property {Prop.DELAY!r}, the delay level's, set by the broker: "
            "give a delay_level column instead"
        )
    return Entries(names, values, parent)


def _entries(props: pa.MapArray) -> tuple[pa.StructArray, np.ndarray]:
    """The (key, value) entries of every row's map, and the row of each (through a list
    of structs: pyarrow's list kernels take no map, and a map's keys ignore a slice)."""
    entries = props.cast(_ENTRIES)
    # the rows from the lengths, as list_flatten sees them: a null row may keep entries
    # under it, which list_flatten leaves out and list_parent_indices would count
    lengths = pc.list_value_length(entries).fill_null(0).to_numpy(zero_copy_only=False)
    parent = np.repeat(np.arange(len(entries), dtype=np.int64), lengths)
    return pc.list_flatten(entries), parent


def _levels(table: pa.Table) -> np.ndarray:
    """The ``delay_level`` column (integers ≥ 0; null: none)."""
    level = _int(_typed(table, "delay_level", _INTS, nulls=True), "delay_level", pa.int64()).fill_null(0)
    arr = level.to_numpy()
    negative = np.nonzero(arr < 0)[0]
    if len(negative):
        row = int(negative[0])
        raise InvalidDelayLevel(
            f"send_arrow: row {row} has delay_level {int(arr[row])}, negative; allowed: 0 (no delay) or a "
            "level of the warehouse's schedule_levels"
        )
    return arr


def _due(
    table: pa.Table, props: Entries | None, level: np.ndarray | None, now: int, horizon_ms: int
) -> pa.Array | None:
    """Each row's timer (epoch ms, null for none): ``deliver_at_ms`` or a
    ``TIMER_DELIVER_MS`` property, one of the two, within the horizon; a ``deliver_at_ms``
    beside a delay level is refused (as ``deliver_at`` is), a property beside it is the
    timer (docs/behaviour.md §2)."""
    n = table.num_rows
    given = None
    if "deliver_at_ms" in table.column_names:
        given = _int(_typed(table, "deliver_at_ms", _INTS, nulls=True), "deliver_at_ms", pa.int64())
        if level is not None:
            both = np.nonzero((level > 0) & ~given.is_null().to_numpy(zero_copy_only=False))[0]
            if len(both):
                raise InvalidTimer(
                    f"send_arrow: row {int(both[0])} has both delay_level={int(level[both[0]])} and "
                    "deliver_at_ms; give one of them"
                )
    from_props = None
    if props is not None:
        timer = pc.equal(props.names, Prop.TIMER_DELIVER_MS).to_numpy(zero_copy_only=False)
        if timer.any():
            rows, raw = props.row[timer], props.values.filter(pa.array(timer))
            ok = pc.match_substring_regex(raw, _TIMER_TEXT).to_numpy(zero_copy_only=False)
            if not ok.all():
                i = int(np.nonzero(~ok)[0][0])
                raise InvalidTimer(
                    f"send_arrow: row {int(rows[i])}'s {Prop.TIMER_DELIVER_MS}={raw[i].as_py()!r} is not an "
                    "absolute time in epoch milliseconds"
                )
            values = np.full(n, -1, dtype=np.int64)
            values[rows] = pc.cast(raw, pa.int64()).to_numpy()
            mask = np.ones(n, dtype=bool)
            mask[rows] = False
            from_props = pa.array(values, pa.int64(), mask=mask)
    due = given if from_props is None else from_props
    if given is not None and from_props is not None:
        both = pc.and_(given.is_valid(), from_props.is_valid())
        if pc.any(both).as_py():
            row = pc.index(both, True).as_py()
            raise InvalidTimer(
                f"send_arrow: row {row} has both deliver_at_ms and a {Prop.TIMER_DELIVER_MS} property; "
                "a message takes one of them"
            )
        due = pc.coalesce(given, from_props)
    if due is None or due.null_count == n:
        return None
    out = (pc.greater(due, now + horizon_ms), pc.less(due, now - horizon_ms))
    for beyond in out:
        if pc.any(beyond).as_py():
            row = pc.index(beyond, True).as_py()
            try:
                check_timer_horizon(due[row].as_py(), now, horizon_ms)
            except InvalidTimer as e:
                raise InvalidTimer(f"send_arrow: row {row}: {e}") from e
    return due


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


def _int(col: pa.ChunkedArray, name: str, to: pa.DataType) -> pa.Array:
    """An integer column as ``to`` (a value beyond it named: InvalidMessage)."""
    try:
        return col.cast(to).combine_chunks()
    except pa.ArrowInvalid as e:
        raise InvalidMessage(f"send_arrow: column {name!r} holds a value beyond {to}: {e}") from e


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
    batch: ArrowBatch, queue_ids: pa.Array, schema: pa.Schema, now: int, producer_group: str, max_level: int
) -> tuple[pa.Table, pa.Array]:
    """The commit_log rows of ``batch`` under one fresh producer batch id, and their msg
    ids (row ``pos`` gets ``msg_id(batch, pos)``, as every send does)."""
    n = len(batch.topic)
    batch_id = ids.new_batch_id(now)
    mids = ids.msg_id_array(batch_id, n)
    properties = stored_properties(batch, mids, max_level)

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


def warn_clamped(above: Iterable[int], max_level: int, logger: logging.Logger = log) -> None:
    """Levels asked ``above`` the warehouse's highest are stored at it, as RocketMQ's
    store does: said, not silent (by ``logger``: the sending module's)."""
    levels = sorted(set(above))
    if levels:
        logger.warning(
            "delay_level %s above the warehouse's highest level %d: stored at level %d",
            ", ".join(map(str, levels)),
            max_level,
            max_level,
        )


def stored_properties(batch: ArrowBatch, mids: pa.Array, max_level: int) -> pa.MapArray:
    """Each row's stored properties: the caller's (but the names the send sets), then
    ``UNIQ_KEY`` (the msg id), ``DELAY`` (the level clamped to ``max_level``) and
    ``TIMER_DELIVER_MS`` (the due time) — what a send of the same ``Message`` stores.
    Built from whole columns: the entries of every row gathered and put in row order."""
    n = len(mids)
    row = np.arange(n, dtype=np.int64)
    if batch.properties is None and batch.delay_level is None and batch.due is None:
        offsets = pa.array(np.arange(n + 1, dtype=np.int32))
        return pa.MapArray.from_arrays(offsets, pa.repeat(pa.scalar(Prop.UNIQ_KEY), n), mids)
    names: list[pa.Array] = [pa.repeat(pa.scalar(Prop.UNIQ_KEY), n)]
    values: list[pa.Array] = [mids]
    parents = [row]
    if batch.properties is not None:
        given = batch.properties
        keep = pc.invert(pc.is_in(given.names, pa.array(_SET_BY_THE_SEND)))
        names.insert(0, given.names.filter(keep))
        values.insert(0, given.values.filter(keep))
        parents.insert(0, given.row[keep.to_numpy(zero_copy_only=False)])
    if batch.delay_level is not None and (batch.delay_level > 0).any():
        delayed = batch.delay_level > 0
        warn_clamped(np.unique(batch.delay_level[batch.delay_level > max_level]).tolist(), max_level)
        names.append(pa.repeat(pa.scalar(Prop.DELAY), int(delayed.sum())))
        values.append(pc.cast(pa.array(np.minimum(batch.delay_level[delayed], max_level)), pa.string()))
        parents.append(row[delayed])
    if batch.due is not None:
        timed = batch.due.is_valid().to_numpy(zero_copy_only=False)
        names.append(pa.repeat(pa.scalar(Prop.TIMER_DELIVER_MS), int(timed.sum())))
        values.append(pc.cast(batch.due.filter(pa.array(timed)), pa.string()))
        parents.append(row[timed])
    parent = np.concatenate(parents)
    order = pa.array(np.argsort(parent, kind="stable"))
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(parent, minlength=n), out=offsets[1:])
    return pa.MapArray.from_arrays(
        pa.array(offsets),
        pa.concat_arrays([a.cast(pa.string()) for a in names]).take(order),
        pa.concat_arrays([a.cast(pa.string()) for a in values]).take(order),
    )
