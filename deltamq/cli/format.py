"""The command line's output formatting: aligned text tables, cells, readable times.

Nothing here imports from ``deltamq.cli``: every command module (and the demo) prints
through it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from deltamq.clock import ms_to_iso

__all__ = ["ms_to_iso", "print_table"]


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
