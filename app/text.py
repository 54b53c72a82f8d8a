"""Text the database cannot store: the one definition the gateway and the API process share.

PostgreSQL's text and JSONB types cannot hold U+0000
(https://www.postgresql.org/docs/current/datatype-json.html), and no database stores a lone
UTF-16 surrogate as UTF-8 (a Python `str` holding U+D800-U+DFFF cannot be encoded).  Python's
JSON parser produces both from the escapes `"\\u0000"` and `"\\ud800"`.  The API process
refuses such a run config (`text_problem`); the gateway must record whatever a harness sends,
so it replaces each such character by U+FFFD (`storable`), as a UTF-8 decoder would.
"""
from __future__ import annotations

import re
from typing import Any

UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # U+0000 and every UTF-16 surrogate code point
# A raw JSON body can only produce those characters through these escapes (raw U+0000 is not
# valid JSON, and a raw surrogate is not valid UTF-8): a cheap test before walking the body.
_UNSTORABLE_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89abcdefABCDEF])")


def text_problem(text: Any) -> str | None:
    """Why `text` cannot be stored, as a phrase to follow a field name; None when it can (or is
    not a string)."""
    if not isinstance(text, str):
        return None
    if "\x00" in text:
        return "must not contain NUL (U+0000) characters"
    if UNSTORABLE.search(text):
        return "must be valid Unicode (a lone UTF-16 surrogate escape is not)"
    return None


def may_hold_unstorable(raw: bytes) -> bool:
    """Whether a raw JSON document holds an escape that parses to text `text_problem` refuses."""
    return b"\\u" in raw and _UNSTORABLE_ESCAPE.search(raw) is not None


def storable(value: Any) -> Any:
    """`value` (parsed JSON) with every unstorable character of its strings and keys replaced by
    U+FFFD (RFC 8259 section 8.2 leaves lone surrogates' behaviour unpredictable).  Recursive:
    a body nested deeper than the interpreter's limit raises RecursionError."""
    if isinstance(value, str):
        return UNSTORABLE.sub("\ufffd", value)
    if isinstance(value, list):
        return [storable(v) for v in value]
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    return value
