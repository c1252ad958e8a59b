"""Building SQL text from validated values only.

Identifiers (table and column names) come from ``deltamq.schemas`` constants; values
are rendered as literals here, escaped, never pasted from user text.
"""

from __future__ import annotations

from collections.abc import Iterable


def sql_str(value: str | None) -> str:
    """A Spark SQL string literal for ``value`` (NULL for None)."""
    if value is None:
        return "CAST(NULL AS STRING)"
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}: {value!r}")
    escaped = value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
    return f"'{escaped}'"


def _sql_integer(value: int | None, sql_type: str) -> str:
    if value is None:
        return f"CAST(NULL AS {sql_type})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return f"CAST({value} AS {sql_type})"


def sql_long(value: int | None) -> str:
    """A BIGINT literal (NULL for None)."""
    return _sql_integer(value, "BIGINT")


def sql_int(value: int | None) -> str:
    """An INT literal (NULL for None)."""
    return _sql_integer(value, "INT")


def sql_bool(value: bool | None) -> str:
    if value is None:
        return "CAST(NULL AS BOOLEAN)"
    return "TRUE" if value else "FALSE"


def sql_in(values: Iterable[str]) -> str:
    """``('a', 'b')`` for an IN list of strings."""
    items = [sql_str(v) for v in values]
    if not items:
        raise ValueError("an IN list needs at least one value")
    return "(" + ", ".join(items) + ")"


USER_GROUPS = "consumer_group NOT LIKE '\\%%'"
"""SQL predicate: rows of consumer groups, not the jobs' progress rows (``%DISPATCH%``, …)."""


def sql_queues(queues: Iterable[tuple[str, int]]) -> str:
    """SQL predicate: ``topic``/``queue_id`` is one of ``queues`` (FALSE for none)."""
    cond = " OR ".join(f"(topic = {sql_str(t)} AND queue_id = {int(q)})" for t, q in sorted(queues))
    return f"({cond})" if cond else "FALSE"
