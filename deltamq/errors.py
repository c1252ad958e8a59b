"""Every error deltamq raises on purpose.

Each class mixes in the matching builtin so that ordinary ``except ValueError``
(or ``LookupError``, ``RuntimeError``) keeps working for callers who do not know
deltamq's hierarchy.
"""

from __future__ import annotations

from collections.abc import Iterator


class DeltaMQError(Exception):
    """Base class of every deltamq error."""


class ConfigError(DeltaMQError, ValueError):
    """A configuration value is outside what is allowed."""


class InvalidName(DeltaMQError, ValueError):
    """A topic, group or client name breaks the naming rule."""


class InvalidTopic(InvalidName):
    """A topic name breaks the naming rule (pattern, length)."""


class InvalidGroup(InvalidName):
    """A consumer or producer group name breaks the naming rule."""


class SystemTopicError(DeltaMQError, PermissionError):
    """A producer or admin call tried to write to a topic only the engine may write."""


class UnknownTopic(DeltaMQError, LookupError):
    """The topic does not exist in this warehouse."""


class UnknownGroup(DeltaMQError, LookupError):
    """The consumer group does not exist in this warehouse."""


class AlreadyExists(DeltaMQError, ValueError):
    """A topic or group with that name already exists."""


class TopicNotWritable(DeltaMQError, PermissionError):
    """The topic's permission does not allow producers to write to it."""


class InvalidMessage(DeltaMQError, ValueError):
    """A message breaks a rule of docs/behaviour.md §1 (body size, properties, delay level, ...)."""


class BodyTooLarge(InvalidMessage):
    """A message body is larger than the maximum message size."""


class InvalidProperties(InvalidMessage):
    """Message properties are not a string-to-string map."""


class InvalidDelayLevel(InvalidMessage):
    """A delay level is negative or not an integer."""


class ClockError(DeltaMQError, ValueError):
    """A tick's ``now`` is earlier than the warehouse's last tick."""


class LeaseHeld(DeltaMQError, RuntimeError):
    """Another holder owns the job lease and it has not expired."""


class LeaseLost(DeltaMQError, RuntimeError):
    """This holder's lease was taken over (its epoch is stale): it must stop writing."""


class CommitConflict(DeltaMQError, RuntimeError):
    """A Delta commit kept failing because other writers committed first."""


class VersionTaken(DeltaMQError, RuntimeError):
    """A conditional commit found its version committed by another writer (a commit
    conflict: the writer reads the table again and plans again; deltamq/delta_append.py)."""


class EngineError(DeltaMQError, RuntimeError):
    """The Spark engine could not be started, reached or used as configured."""


class SchemaVersionError(DeltaMQError, RuntimeError):
    """The warehouse was written by a newer deltamq schema than this release knows."""


class TableDamaged(DeltaMQError, RuntimeError):
    """A data file the Delta log references is missing or truncated (``damage`` lists
    them; see deltamq/tables/integrity.py). The failed job committed nothing."""

    def __init__(self, message: str, damage: list | None = None) -> None:
        super().__init__(message)
        self.damage = damage or []


class OperationError(DeltaMQError, RuntimeError):
    """An operator command cannot run on this warehouse as it is (nothing was changed)."""


class ReadOnlyQuery(DeltaMQError, PermissionError):
    """A statement that changes tables was given where only reads are allowed."""


class FilterSyntaxError(DeltaMQError, ValueError):
    """A subscription expression cannot be parsed; the message gives the position."""


class InvalidTimer(InvalidMessage):
    """A timer's due time is malformed or outside the allowed horizon."""


class InvalidTransaction(DeltaMQError, ValueError):
    """A transaction id or state is not allowed (unknown id, not a half message, bad state)."""


class StorageError(DeltaMQError, OSError):
    """A warehouse location cannot be listed, read or written; names the URI and the cause."""


class InUse(DeltaMQError, RuntimeError):
    """A delete that would drop subscriptions or messages not yet consumed (pass
    ``force=True`` / ``--force`` to delete anyway)."""


class WarehouseNotFound(DeltaMQError, FileNotFoundError):
    """No deltamq warehouse at the location given (and the command does not create one)."""


class ListenerUnavailable(ConfigError):
    """A listener, check listener or sink transform given by import path cannot be
    imported (or is not callable) in the process that needs it: a set-up error, not a
    failure of the message."""


class UnsafeStorage(ConfigError):
    """The store cannot make concurrent Delta commits safe with the settings given."""


def first_line(error: BaseException) -> str:
    """An error's first line of text (its type's name when it has none)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def cause_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then each error it was raised from (``__cause__``), each once."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__


class InProcessListener(UserWarning):
    """A listener given as a callable that only this process has (a lambda, a nested
    function, a function of ``__main__``): other processes that tick the warehouse cannot
    deliver to it and fail naming the group."""
