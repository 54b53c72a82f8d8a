"""Text the database cannot store (`app.text`): one definition for the API process and the gateway."""
from __future__ import annotations

import json

import pytest

from app.text import may_hold_unstorable, storable, text_problem


@pytest.mark.parametrize("text,problem", [
    ("plain", None), ("\u00e9\U0001F600", None), (3, None), (None, None),
    ("a\x00b", "must not contain NUL (U+0000) characters"),
    ("\ud83d", "must be valid Unicode (a lone UTF-16 surrogate escape is not)"),
    ("x\udfff", "must be valid Unicode (a lone UTF-16 surrogate escape is not)"),
])
def test_text_problem_names_what_sql_refuses(text, problem):
    assert text_problem(text) == problem


def test_what_text_problem_refuses_really_cannot_be_encoded_or_stored():
    for text in ("\ud800", "\udc00"):
        with pytest.raises(UnicodeEncodeError):
            text.encode("utf-8")
    assert text_problem(storable("a\x00\ud800b")) is None


@pytest.mark.parametrize("raw,hit", [
    (b'{"a": "\\u0000"}', True), (b'{"a": "\\ud800"}', True), (b'{"a": "\\uDFFF"}', True),
    (b'{"a": "\\u00e9"}', False), (b'{"a": "\\ue000"}', False), (b'{"a": "u0000"}', False),
])
def test_the_raw_precheck_finds_every_escape_that_parses_to_unstorable_text(raw, hit):
    assert may_hold_unstorable(raw) is hit
    assert (text_problem(json.loads(raw)["a"]) is not None) is hit


def test_storable_replaces_in_keys_and_values_at_any_depth_and_keeps_other_values():
    value = {"k\x00": [{"deep": ["\ud83d!"]}, 1.5, True, None]}
    assert storable(value) == {"k\ufffd": [{"deep": ["\ufffd!"]}, 1.5, True, None]}
