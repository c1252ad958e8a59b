"""Read-only SQL: what ``deltamq sql`` (and ``Broker.sql``) run without ``--write``.

A prefix test ("starts with SELECT") is not enough: Apache Spark runs
``WITH x AS (...) INSERT INTO t ...`` and some endpoints accept several statements in
one string. So the statement is split into tokens the way Spark's lexer does (string
literals, backquoted identifiers and comments are opaque) and refused if it holds more
than one statement, does not start with a query keyword, or names a statement keyword
that changes data or the session anywhere outside quotes. A word used as a function
(``replace(body, 'a', 'b')``) is a function, not a statement. Engine-independent: it
holds on Sail, on Apache Spark and on any Spark Connect endpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deltamq.errors import ReadOnlyQuery

QUERY_START = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "VALUES", "TABLE", "FROM")
WRITE_WORDS = frozenset(
    {
        "INSERT",
        "MERGE",
        "UPDATE",
        "DELETE",
        "CREATE",
        "DROP",
        "ALTER",
        "TRUNCATE",
        "OVERWRITE",
        "CACHE",
        "UNCACHE",
        "REFRESH",
        "SET",
        "RESET",
        "ADD",
        "LOAD",
        "MSCK",
        "USE",
        "GRANT",
        "REVOKE",
        "COPY",
        "OPTIMIZE",
        "VACUUM",
        "RESTORE",
        "CLONE",
        "ANALYZE",
        "REPAIR",
        "CALL",
        "EXECUTE",
        "DECLARE",
    }
)

_TOKEN = re.compile(
    r"""
      (?P<space>\s+)
    | (?P<line_comment>--[^\n]*)
    | (?P<block_comment>/\*.*?(?:\*/|\Z))
    | (?P<string>'(?:\\.|[^'\\])*(?:'|\Z)|"(?:\\.|[^"\\])*(?:"|\Z))
    | (?P<ident>`(?:``|[^`])*(?:`|\Z))
    | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<number>[0-9][0-9A-Za-z_.]*)
    | (?P<punct>.)
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass(frozen=True)
class Token:
    kind: str  # space, line_comment, block_comment, string, ident, word, number, punct
    text: str
    start: int


def tokens(statement: str) -> list[Token]:
    """Spark SQL tokens of ``statement`` (an unclosed quote or comment runs to the end)."""
    return [Token(m.lastgroup or "punct", m.group(), m.start()) for m in _TOKEN.finditer(statement)]


def check_read_only(statement: str) -> None:
    """Raise ReadOnlyQuery unless ``statement`` is one query that changes nothing."""
    code = [t for t in tokens(statement) if t.kind not in ("space", "line_comment", "block_comment")]
    refused = "; pass write=True (CLI: --write) to change tables"
    semis = [i for i, t in enumerate(code) if t.text == ";"]
    if any(i != len(code) - 1 for i in semis):
        raise ReadOnlyQuery(
            f"{statement.strip()[:60]!r} holds more than one statement; run them one at a time "
            "(one that changes tables with write=True, CLI: --write)"
        )
    first = next((t.text.upper() for t in code if t.text != "("), "")
    if first not in QUERY_START:
        raise ReadOnlyQuery(
            f"only queries ({', '.join(QUERY_START)}) are allowed here; got {statement.strip()[:60]!r}"
            + refused
        )
    for i, t in enumerate(code):
        if t.kind != "word" or t.text.upper() not in WRITE_WORDS:
            continue
        after = code[i + 1].text if i + 1 < len(code) else ""
        before = code[i - 1].text if i else ""
        if after == "(" or before == ".":  # a function call or a qualified column name
            continue
        if i == 1 and first == "SHOW" and t.text.upper() == "CREATE":  # SHOW CREATE TABLE
            continue
        raise ReadOnlyQuery(
            f"{t.text.upper()} at position {t.start} of {statement.strip()[:60]!r} changes tables or "
            f"the session{refused} (a column of that name: quote it as `{t.text}`)"
        )


__all__ = ["QUERY_START", "WRITE_WORDS", "Token", "check_read_only", "tokens"]
