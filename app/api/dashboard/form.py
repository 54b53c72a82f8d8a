"""The submit form's fields, generated from the `RunConfig` schema the API publishes.

The form is built from the same OpenAPI document clients read (`/api/openapi.json`), so a
new run option appears in the form without touching the dashboard.  Validation stays with
the API: the page posts the JSON and shows the API's 400 messages next to the fields.
"""
from __future__ import annotations

from typing import Any


def _resolve(schema: dict, schemas: dict) -> dict:
    ref = schema.get("$ref")
    return schemas[ref.rsplit("/", 1)[-1]] if ref else schema


def _unwrap_optional(schema: dict, schemas: dict) -> tuple[dict, bool]:
    """`anyOf: [X, {"type": "null"}]` -> (X, True)."""
    options = schema.get("anyOf")
    if options:
        real = [o for o in options if o.get("type") != "null"]
        if len(real) == 1:
            merged = {**_resolve(real[0], schemas), **{k: v for k, v in schema.items() if k != "anyOf"}}
            return merged, True
    return _resolve(schema, schemas), False


def form_fields(schema: dict, schemas: dict, prefix: str = "") -> list[dict]:
    """Fields of an object schema as a tree: groups (nested objects) and inputs.

    Each input: {kind: "input", path, label, input: select|text|list, type, options, default,
    description, required}.  Each group: {kind: "group", path, label, description, optional, fields}.
    """
    required = set(schema.get("required") or [])
    out: list[dict[str, Any]] = []
    for name, raw in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        prop, optional = _unwrap_optional(raw, schemas)
        label = raw.get("title") or prop.get("title") or name
        description = raw.get("description") or prop.get("description") or ""
        if prop.get("type") == "object" and prop.get("properties"):
            out.append({"kind": "group", "path": path, "label": name, "description": description.split("\n\n")[0],
                        "optional": optional, "fields": form_fields(prop, schemas, path + ".")})
            continue
        field: dict[str, Any] = {"kind": "input", "path": path, "label": label, "name": name, "description": description,
                                 "default": raw.get("default", prop.get("default")), "required": name in required,
                                 "type": prop.get("type", "string"), "options": None, "input": "text"}
        if "enum" in prop:
            field.update(input="select", options=list(prop["enum"]))
        elif prop.get("type") == "boolean":
            field.update(input="select", options=[True, False])
        elif prop.get("type") == "array":
            field.update(input="list")
        out.append(field)
    return out


def run_config_form(spec: dict) -> list[dict]:
    """The form tree of `RunConfig` from an OpenAPI document."""
    schemas = spec["components"]["schemas"]
    return form_fields(schemas["RunConfig"], schemas)
