"""Subscription expressions: RocketMQ tag expressions (``*``, ``TagA || TagB``) and
SQL92 filters over properties.

Tags are matched on ``consume_queue.tags_hash`` first and the tag string after, as
RocketMQ matches the consume queue's tag hash code and then the commit log's tag.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from deltamq.config import EXPRESSION_TYPES, Subscription
from deltamq.errors import FilterSyntaxError

if TYPE_CHECKING:
    from pyspark.sql import Column


def parse_tag_expression(expression: str) -> list[str] | None:
    """``"*"`` → None (everything); ``"A || B"`` → ["A", "B"].

    >>> parse_tag_expression(" TagA || TagB ")
    ['TagA', 'TagB']
    """
    if not isinstance(expression, str):
        raise FilterSyntaxError(f"tag expression {expression!r} is not a string")
    text = expression.strip()
    if text in ("", "*"):
        return None
    tags = []
    for pos, part in _split(text):
        tag = part.strip()
        if not tag:
            raise FilterSyntaxError(
                f"tag expression {expression!r} has an empty tag at position {pos}; "
                "write '*' or tags separated by '||', e.g. 'TagA || TagB'"
            )
        if tag == "*" or any(ch.isspace() for ch in tag):
            raise FilterSyntaxError(
                f"tag {tag!r} in expression {expression!r} (position {pos}) is not allowed; "
                "tags have no spaces and '*' stands alone"
            )
        if tag not in tags:
            tags.append(tag)
    return tags


def _split(text: str) -> list[tuple[int, str]]:
    parts, start = [], 0
    while True:
        i = text.find("||", start)
        if i < 0:
            parts.append((start, text[start:]))
            return parts
        parts.append((start, text[start:i]))
        start = i + 2


def validate_expression(expression: str, expr_type: str = "TAG") -> str:
    """Check a subscription expression at subscribe time; returns its normal form."""
    if expr_type not in EXPRESSION_TYPES:
        raise FilterSyntaxError(
            f"expression type {expr_type!r} is not allowed; use one of {EXPRESSION_TYPES}"
        )
    if expr_type == "SQL92":
        parse_sql92(expression)
        return expression.strip()
    try:
        tags = parse_tag_expression(expression)
    except FilterSyntaxError as e:
        try:
            parse_sql92(expression)
        except FilterSyntaxError:
            raise e from None
        raise FilterSyntaxError(
            f"{e}. It reads as an SQL92 filter: subscribe with type='SQL92' (CLI: --type SQL92)"
        ) from None
    quoted = [t for t in tags or () if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\""]
    if quoted:
        raise FilterSyntaxError(
            f"tag {quoted[0]!r} in expression {expression!r} is quoted: the quotes would be part "
            f"of the tag; write {quoted[0][1:-1]!r} (quotes a shell needs go around the whole "
            "expression only)"
        )
    return "*" if tags is None else " || ".join(tags)


# --- SQL92 -------------------------------------------------------------------------------
# RocketMQ's SQL92 subset over message properties (plus TAGS and KEYS). A small
# recursive-descent parser (no dependency): every token is matched against an allow-list,
# literals become Spark literals, identifiers become property look-ups; the user's text is
# never pasted into SQL.

_MAX_DEPTH = 64
_KEYWORDS = {"AND", "OR", "NOT", "IN", "BETWEEN", "IS", "NULL", "TRUE", "FALSE"}
_COMPARE = ("=", "<>", "!=", "<=", ">=", "<", ">")
_NUMERIC = r"^-?[0-9]+(\.[0-9]+)?$"


class _Tok:
    __slots__ = ("kind", "value", "pos")

    def __init__(self, kind: str, value, pos: int) -> None:
        self.kind, self.value, self.pos = kind, value, pos

    def __repr__(self) -> str:
        return f"{self.kind}:{self.value!r}@{self.pos}"


def _tokens(text: str) -> list[_Tok]:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "'":
            j, buf = i + 1, []
            while True:
                if j >= n:
                    raise FilterSyntaxError(
                        f"SQL92 expression: unterminated string starting at position {i + 1}"
                    )
                if text[j] == "'":
                    if j + 1 < n and text[j + 1] == "'":
                        buf.append("'")
                        j += 2
                        continue
                    break
                buf.append(text[j])
                j += 1
            out.append(_Tok("str", "".join(buf), i + 1))
            i = j + 1
        elif c.isdigit() or (c == "-" and i + 1 < n and text[i + 1].isdigit()):
            j = i + 1
            while j < n and (text[j].isdigit() or text[j] == "."):
                j += 1
            raw = text[i:j]
            try:
                out.append(_Tok("num", float(raw), i + 1))
            except ValueError:
                raise FilterSyntaxError(f"SQL92 expression: bad number {raw!r} at position {i + 1}") from None
            i = j
        elif c.isalpha() or c == "_":
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] in "_.$"):
                j += 1
            word = text[i:j]
            if word.upper() in _KEYWORDS:
                out.append(_Tok("kw", word.upper(), i + 1))
            else:
                out.append(_Tok("ident", word, i + 1))
            i = j
        elif text.startswith(("<>", "!=", "<=", ">="), i):
            out.append(_Tok("op", text[i : i + 2], i + 1))
            i += 2
        elif c in "=<>(),":
            out.append(_Tok("op", c, i + 1))
            i += 1
        else:
            raise FilterSyntaxError(
                f"SQL92 expression: unexpected character {c!r} at position {i + 1}; allowed are "
                "properties, 'strings', numbers, = <> < <= > >= IN BETWEEN IS [NOT] NULL AND OR NOT ( )"
            )
    out.append(_Tok("end", None, n + 1))
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def _err(self, what: str) -> FilterSyntaxError:
        t = self.tok
        found = "end of expression" if t.kind == "end" else repr(t.value)
        return FilterSyntaxError(f"SQL92 expression: {what} at position {t.pos}, found {found}")

    def _accept(self, kind: str, value=None) -> _Tok | None:
        t = self.tok
        if t.kind == kind and (value is None or t.value == value):
            self.i += 1
            return t
        return None

    def _expect(self, kind: str, value, what: str) -> _Tok:
        t = self._accept(kind, value)
        if t is None:
            raise self._err(f"expected {what}")
        return t

    def parse(self):
        node = self._or()
        if self.tok.kind != "end":
            raise self._err("unexpected text after the expression")
        return node

    def _or(self):
        node = self._and()
        while self._accept("kw", "OR"):
            node = ("or", node, self._and())
        return node

    def _and(self):
        node = self._not()
        while self._accept("kw", "AND"):
            node = ("and", node, self._not())
        return node

    def _not(self):
        if self._accept("kw", "NOT"):
            self._enter()
            node = ("not", self._not())
            self.depth -= 1
            return node
        return self._predicate()

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self._err(f"expression nested more than {_MAX_DEPTH} deep")

    def _predicate(self):
        if self._accept("op", "("):
            self._enter()
            node = self._or()
            self._expect("op", ")", "')'")
            self.depth -= 1
            return node
        if self.tok.kind == "kw" and self.tok.value in ("TRUE", "FALSE") and not self._is_compare_next():
            return ("bool", self._accept("kw").value == "TRUE")
        left = self._operand()
        t = self.tok
        if t.kind == "op" and t.value in _COMPARE:
            self.i += 1
            op = "<>" if t.value == "!=" else t.value
            right = self._operand()
            if op not in ("=", "<>") and "str" in (left[0], right[0]):
                raise FilterSyntaxError(
                    f"SQL92 expression: {op} compares numbers only, at position {t.pos}; "
                    "use = or <> for strings"
                )
            return ("cmp", op, left, right)
        negated = bool(self._accept("kw", "NOT"))
        if self._accept("kw", "IN"):
            self._expect("op", "(", "'(' after IN")
            items = [self._literal()]
            while self._accept("op", ","):
                items.append(self._literal())
            self._expect("op", ")", "')' closing the IN list")
            return ("in", left, items, negated)
        if self._accept("kw", "BETWEEN"):
            lo = self._literal("num")
            self._expect("kw", "AND", "AND in BETWEEN … AND …")
            hi = self._literal("num")
            return ("between", left, lo, hi, negated)
        if negated:
            raise self._err("expected IN or BETWEEN after NOT")
        if self._accept("kw", "IS"):
            neg = bool(self._accept("kw", "NOT"))
            self._expect("kw", "NULL", "NULL after IS [NOT]")
            return ("isnull", left, neg)
        raise self._err("expected a comparison, IN, BETWEEN or IS [NOT] NULL")

    def _is_compare_next(self) -> bool:
        nxt = self.toks[self.i + 1]
        return nxt.kind == "op" and nxt.value in _COMPARE

    def _operand(self):
        t = self.tok
        if t.kind == "ident":
            self.i += 1
            return ("ident", t.value)
        if t.kind in ("str", "num"):
            self.i += 1
            return (t.kind, t.value)
        if t.kind == "kw" and t.value in ("TRUE", "FALSE"):
            self.i += 1
            return ("str", t.value.lower())
        raise self._err("expected a property name or a literal")

    def _literal(self, kind: str | None = None):
        t = self.tok
        if t.kind in ("str", "num") and (kind is None or t.kind == kind):
            self.i += 1
            return (t.kind, t.value)
        raise self._err("expected a number" if kind == "num" else "expected a literal")


def parse_sql92(expression: str):
    """Parse an SQL92 filter; FilterSyntaxError gives the position of the problem."""
    if not isinstance(expression, str) or not expression.strip():
        raise FilterSyntaxError("SQL92 expression is empty; e.g. \"region = 'eu' AND amount > 100\"")
    if len(expression) > 10_000:
        raise FilterSyntaxError(
            f"SQL92 expression is {len(expression)} characters; at most 10000 are allowed"
        )
    return _Parser(expression).parse()


def compile_sql92(expression: str, properties: str = "properties", tags: str = "tags", keys: str = "keys"):
    """A Spark boolean Column equal to the filter (missing properties never match)."""
    from pyspark.sql import functions as F

    def value(node):
        kind, v = node
        if kind == "ident":
            if v == "TAGS":
                return F.col(tags)
            if v == "KEYS":
                return F.col(keys)
            return F.col(properties).getItem(v)
        return F.lit(v if kind == "str" else float(v))

    def number(node):
        if node[0] == "num":
            return F.lit(float(node[1]))
        col = value(node)
        return F.when(col.rlike(_NUMERIC), col.cast("double"))

    def compare(op, a, b):
        return {
            "=": a == b,
            "<>": a != b,
            "<": a < b,
            "<=": a <= b,
            ">": a > b,
            ">=": a >= b,
        }[op]

    def build(node):
        kind = node[0]
        if kind == "or":
            return build(node[1]) | build(node[2])
        if kind == "and":
            return build(node[1]) & build(node[2])
        if kind == "not":
            return ~build(node[1])
        if kind == "bool":
            return F.lit(node[1])
        if kind == "cmp":
            _, op, left, right = node
            if "num" in (left[0], right[0]):
                return compare(op, number(left), number(right))
            if left[0] == right[0] == "ident" and op not in ("=", "<>"):
                return compare(op, number(left), number(right))
            return compare(op, value(left), value(right))
        if kind == "in":
            _, left, items, negated = node
            if all(k == "num" for k, _ in items):
                expr = number(left).isin([float(v) for _, v in items])
            else:
                expr = value(left).isin([v if k == "str" else _num_text(v) for k, v in items])
            return ~expr if negated else expr
        if kind == "between":
            _, left, lo, hi, negated = node
            expr = number(left).between(float(lo[1]), float(hi[1]))
            return ~expr if negated else expr
        if kind == "isnull":
            _, left, negated = node
            col = value(left)
            return col.isNotNull() if negated else col.isNull()
        raise AssertionError(node)  # pragma: no cover

    return F.coalesce(build(parse_sql92(expression)), F.lit(False))


def _num_text(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def tags_match(tag_list: Column) -> Column:
    """Spark Column: a ``consume_queue`` row's tag is in the array column ``tag_list`` (a
    NULL array matches every row) — its ``tags_hash`` first, the tag string after. The
    one tag matcher: push delivery ships each take's list as data, pull clients, sinks
    and the accounting give a literal array."""
    from pyspark.sql import functions as F

    return tag_list.isNull() | (
        F.col("tags").isNotNull()
        & F.exists(tag_list, lambda x: F.xxhash64(x) == F.col("tags_hash"))
        & F.array_contains(tag_list, F.col("tags"))
    )


def subscription_filter(sub: Subscription) -> Column:
    """Spark Column: a ``consume_queue`` row matches subscription ``sub`` (its tag list or
    SQL92 predicate; ``*`` matches everything)."""
    from pyspark.sql import functions as F

    if sub.expr_type == "SQL92":
        return compile_sql92(sub.expression)
    tags = parse_tag_expression(sub.expression)
    if tags is None:
        return F.lit(True)
    return tags_match(F.array(*[F.lit(t) for t in tags]))


def subscriptions_filter(subs: Iterable[Subscription], default: bool = False):
    """Spark Column: a row matches the subscription of its topic among ``subs``; a row of
    any other topic is ``default``."""
    from pyspark.sql import functions as F

    out = F.lit(default)
    for sub in subs:
        out = F.when(F.col("topic") == sub.topic, subscription_filter(sub)).otherwise(out)
    return out
