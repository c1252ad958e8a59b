"""The command line's output formatting: aligned text tables, cells, readable times, and
``--json`` (one JSON document per command, :func:`emit`).

Nothing here imports from ``deltamq.cli``: every command module (and the demo) prints
through it.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from deltamq.clock import ms_to_iso

__all__ = ["duration", "emit", "json_line", "jsonable", "ms_to_iso", "print_table"]


def emit(
    args: argparse.Namespace, data: Mapping[str, Any], render: Callable[[], None], status: int = 0
) -> int:
    """A command's result: ``render()`` prints it as text (tables), or with ``--json`` the
    ``data`` are printed as one JSON document. Returns ``status`` (the exit status)."""
    if getattr(args, "json", False):
        print(json_line(data), flush=True)
    else:
        render()
    return status


def json_line(data: Any) -> str:
    """``data`` as one line of JSON (bytes as UTF-8 text, or base64 when they are not text)."""
    return json.dumps(jsonable(data), sort_keys=False, allow_nan=False)


def jsonable(v: Any) -> Any:
    """``v`` with what JSON cannot hold made plain: rows and mappings as objects, bytes as
    text, dates as ISO strings, decimals as strings (exact), tuples and sets as lists, a
    float that is not a number (NaN, ±infinity: no JSON value) as its name, a string."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if hasattr(v, "asDict"):  # a pyspark Row
        return jsonable(v.asDict(recursive=True))
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, bytes | bytearray | memoryview):
        data = bytes(v)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(data).decode("ascii")}
    if isinstance(v, datetime | date):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, list | tuple | set | frozenset):
        return [jsonable(x) for x in v]
    if hasattr(v, "__dataclass_fields__"):
        return {k: jsonable(getattr(v, k)) for k in v.__dataclass_fields__}
    return str(v)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], out=None) -> None:
    """Print rows as an aligned text table."""
    out = out or sys.stdout
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=False)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False))
    print(line.rstrip(), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip(), file=out)
    if not rows:
        print("(no rows)", file=out)


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes | bytearray):
        try:
            text = bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            return f"<{len(v)} bytes>"
        return text if len(text) <= 60 else text[:57] + "..."
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    return str(v)


def duration(ms: int | float | None) -> str:
    """A length of time the way delay levels are written: ``500ms``, ``10s``, ``30m``,
    ``2h``, ``1.5s``; ``-`` for None."""
    if ms is None:
        return "-"
    if ms > 86_400_000 and ms % 3_600_000:  # days, not 2.17976e+08s (whole hours stay hours)
        return f"{ms / 86_400_000:.1f}d"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and (ms % size == 0 or unit == "s"):
            return f"{ms / size:g}{unit}"
    return f"{ms:g}ms"


def shorten(text: str, width: int) -> str:
    """``text`` on one line, cut at a word boundary to at most ``width`` characters (``…``
    marks a cut); a single word longer than that is cut inside."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    cut = flat[: width - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > width // 2 else cut).rstrip(" ,;:") + "…"
