"""Subscription expressions: RocketMQ tag expressions (``*``, ``TagA || TagB``).

Tags are matched on ``consume_queue.tags_hash`` first and the tag string after, as
RocketMQ matches the consume queue's tag hash code and then the commit log's tag.
"""

from __future__ import annotations

from deltamq.errors import FilterSyntaxError

EXPRESSION_TYPES = ("TAG", "SQL92")


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
        raise FilterSyntaxError(
            "SQL92 subscriptions are not available in this release; subscribe with a TAG "
            "expression ('*' or 'TagA || TagB')"
        )
    tags = parse_tag_expression(expression)
    return "*" if tags is None else " || ".join(tags)
