"""Run-config problems in words a newcomer can act on: the value received, and a "did you mean".

pydantic's own messages ("Extra inputs are not permitted", "Input should be a valid number") say
neither what was sent nor what was meant.  Each problem here is `{"field", "message"}`, the
field a dotted path (`training.learning_rate`), the message naming the value received and, for an
unknown field, the closest known field names (`difflib`'s ratio, cutoff 0.6, as Python's own
"Did you mean" suggestions use).
"""
from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

VALUE_ECHO_CHARS = 80  # a received value is quoted up to this many characters
# pydantic error types where the input had the wrong type for a number
NUMBER_TYPES = {"float_type", "float_parsing", "int_type", "int_parsing", "int_from_float"}
# A number as YAML 1.1 (PyYAML) reads it only with a dot: `1e-5` is the string "1e-5", `1.0e-5` a float.
YAML_EXPONENT = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")


def fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """The field names of the sub-model at `path` (a tuple of field names) of `model`; [] when the
    path does not lead to a model (a list item, a dict)."""
    for name in path:
        field = model.model_fields.get(str(name))
        if field is None:
            return []
        found = _model_of(field.annotation)
        if found is None:
            return []
        model = found
    return list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None


def did_you_mean(name: str, known: list[str]) -> str:
    """`; did you mean 'task_set'?` for a close known name, else `; known fields: a, b, ...`."""
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    return "; known fields: " + ", ".join(known) if known else ""


def received(value: Any) -> str:
    """`got '1e-5' (a string)`: the value as sent, shortened, with its JSON type."""
    kind = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    if isinstance(value, (dict, list)):
        return f"got {kind}"
    text = repr(value)
    if len(text) > VALUE_ECHO_CHARS:
        text = text[:VALUE_ECHO_CHARS] + "…"
    return f"got {text} ({kind})"


def schema_problems(exc: ValidationError, model: type[BaseModel]) -> list[dict]:
    """Every problem of `exc` (raised validating `model`) as `{"field", "message"}` dicts."""
    details = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc)
        msg = err["msg"]
        kind = err["type"]
        if kind == "value_error":
            # model-level checks word their problems as "field: message", one per line
            msg = msg.removeprefix("Value error, ")
            for line in msg.splitlines():
                sub, sep, text = line.partition(": ")
                if sep and re.fullmatch(r"[\w.]+", sub):
                    details.append({"field": f"{field}.{sub}" if field and not sub.startswith(field) else sub,
                                    "message": text})
                else:
                    details.append({"field": field or None, "message": line})
            continue
        if kind == "extra_forbidden":
            msg = f"unknown field ({received(err.get('input'))})" + did_you_mean(loc[-1], fields_at(model, loc[:-1]))
        elif "input" in err and kind != "missing":
            value = err["input"]
            msg = f"{msg}; {received(value)}"
            if kind in NUMBER_TYPES and isinstance(value, str) and YAML_EXPONENT.match(value.strip()):
                msg += (f". YAML reads {value} (an exponent without a dot) as text: write {_with_dot(value.strip())}"
                        " (unquoted)")
        details.append({"field": field or None, "message": msg})
    return details


def _with_dot(text: str) -> str:
    """`1e-5` -> `1.0e-5` (the form YAML 1.1 reads as a number)."""
    mantissa, e, exponent = re.split(r"([eE])", text, maxsplit=1)
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}{e}{exponent}"
