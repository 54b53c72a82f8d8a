"""The bug kinds of the `family` task set: each rewrites one spot of one `return` expression.

A kind is a rule on the expression's text; `mutate(kind, body)` returns the buggy bodies, one
per spot of that kind in it.  Kinds, with an example each:

* `operator`   an arithmetic operator changed:   `a - b` -> `a + b`, `x ** 3` -> `x * 3`
* `comparison` a comparison changed:             `age >= 18` -> `age > 18`, `x == 0` -> `x != 0`
* `constant`   an integer literal moved by one:  `age >= 18` -> `age >= 19`
* `index`      an index or slice moved:          `items[-1]` -> `items[-2]`, `items[1:]` -> `items[2:]`
* `builtin`    a builtin or method swapped:      `max(` -> `min(`, `.upper()` -> `.lower()`
* `logic`      a boolean operator changed:       ` and ` -> ` or `, `not x` -> `x`
* `swap`       two operands swapped:             `a - b` -> `b - a`           (out of family)
* `drop_call`  a wrapping call removed:          `abs(a - b)` -> `a - b`      (out of family)

The first six are the family's train / held-out distribution; `swap` and `drop_call` never
appear in train and form the out-of-family split (`OUT_OF_FAMILY`).
"""
from __future__ import annotations

import re

IN_FAMILY = ("operator", "comparison", "constant", "index", "builtin", "logic")
OUT_OF_FAMILY = ("swap", "drop_call")
KINDS = IN_FAMILY + OUT_OF_FAMILY

_OPERATORS = {"**": "*", "//": "/", "+": "-", "-": "+", "*": "+", "/": "*", "%": "//"}
_COMPARISONS = {"<=": "<", ">=": ">", "==": "!=", "!=": "==", "<": "<=", ">": ">="}
_INDEXES = {"[::-1]": "[::1]", "[-1]": "[-2]", "[0]": "[1]", "[1]": "[0]", "[1:]": "[2:]", "[:-1]": "[:-2]",
            "[:2]": "[:3]", "[1::2]": "[::2]"}
_BUILTINS = {"max(": "min(", "min(": "max(", "sum(": "len(", "any(": "all(", "all(": "any(",
             ".upper()": ".lower()", ".lower()": ".upper()", ".startswith(": ".endswith(",
             ".endswith(": ".startswith(", ".lstrip(": ".rstrip(", "sorted(": "list(", "set(": "list(",
             ".count(": ".index(", ".zfill(": ".ljust("}
_DROPPABLE = ("abs", "int", "round", "bool", "len", "str", "sorted", "set")

# An operator token between spaces (the pool writes binary operators with a space on each side).
_OP_RE = re.compile(r" (\*\*|//|\+|-|\*|/|%) ")
_CMP_RE = re.compile(r" (<=|>=|==|!=|<|>) ")
_INT_RE = re.compile(r"(?<![\w.\[:\-])(\d+)(?![\w.\]])")
_SWAP_RE = re.compile(r"\b([a-z_]\w*) (-|/|//|%|<|<=|>|>=) ([a-z_]\w*)\b")


def _spots(body: str, table: dict[str, str]) -> list[str]:
    """`body` with one occurrence of a key of `table` replaced, for each occurrence left to right
    (at one position the longest key wins, so `//` is never read as `/`)."""
    out, at = [], 0
    keys = sorted(table, key=len, reverse=True)
    while at < len(body):
        old = next((k for k in keys if body.startswith(k, at)), None)
        if old is None:
            at += 1
            continue
        out.append(body[:at] + table[old] + body[at + len(old):])
        at += len(old)
    return out


def _regex(body: str, pattern: re.Pattern, table: dict[str, str]) -> list[str]:
    return [body[:m.start(1)] + table[m.group(1)] + body[m.end(1):] for m in pattern.finditer(body)]


def _drop_call(body: str) -> list[str]:
    """`name(inner, ...)` -> `inner` for the first call of a droppable builtin with balanced parentheses."""
    m = re.search(r"\b(" + "|".join(_DROPPABLE) + r")\(", body)
    if m is None:
        return []
    depth, start = 0, m.end() - 1
    for i in range(start, len(body)):
        depth += {"(": 1, ")": -1}.get(body[i], 0)
        if depth == 0:
            inner = body[start + 1:i]
            level, cut = 0, len(inner)
            for j, c in enumerate(inner):  # the first argument only (round(x, 1) -> x)
                level += {"(": 1, ")": -1, "[": 1, "]": -1}.get(c, 0)
                if c == "," and level == 0:
                    cut = j
                    break
            return [body[:m.start()] + inner[:cut].strip() + body[i + 1:]]
    return []


def mutate(kind: str, body: str) -> list[str]:
    """The expression `body` with bug `kind` planted, once for each spot of that kind, left to
    right ([] when it has none).

    Raises ValueError for an unknown kind.
    """
    if kind == "operator":
        return _regex(body, _OP_RE, _OPERATORS)
    if kind == "comparison":
        return _regex(body, _CMP_RE, _COMPARISONS)
    if kind == "constant":
        return [body[:m.start()] + str(int(m.group(1)) + 1) + body[m.end():] for m in _INT_RE.finditer(body)]
    if kind == "index":
        return _spots(body, _INDEXES)
    if kind == "builtin":
        return _spots(body, _BUILTINS)
    if kind == "logic":
        return _spots(body, {" and ": " or ", " or ": " and "}) + ([body[4:]] if body.startswith("not ") else [])
    if kind == "swap":
        return [body[:m.start()] + f"{m.group(3)} {m.group(2)} {m.group(1)}" + body[m.end():]
                for m in _SWAP_RE.finditer(body)]
    if kind == "drop_call":
        return _drop_call(body)
    raise ValueError(f"unknown bug kind {kind!r}; one of {', '.join(KINDS)}")
