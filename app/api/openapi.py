"""OpenAPI 3.1 document for the REST API, served at /api/openapi.json.

Every schema is generated from a pydantic model: the request body from `RunConfig` (the
validation itself) and the responses from `app.api.schemas` (the models every response is
built through), so the document, the validation and the answers cannot disagree.
"""
from __future__ import annotations

from functools import lru_cache

from pydantic.json_schema import models_json_schema

from app.api.schemas import RESPONSE_MODELS
from app.runconfig import RunConfig

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "field": {"type": ["string", "null"]},
                "details": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["message"],
        }
    },
    "required": ["error"],
}


_TAGS = {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_.:+=-]*$", "maxLength": 64}}
_LABELS = {  # PATCH /api/runs/{run_id} (app.api.labels); POST /api/runs takes name, tags and notes too
    "type": "object", "additionalProperties": False,
    "properties": {"name": {"type": ["string", "null"], "maxLength": 200, "description": "one line; null or \"\" clears"},
                   "notes": {"type": ["string", "null"], "maxLength": 10000, "description": "null or \"\" clears"},
                   "tags": {**_TAGS, "description": "replaces every tag (lowercased)"},
                   "add_tags": _TAGS, "remove_tags": _TAGS},
}


def _json(schema_ref: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": schema_ref}}}}


def _id_param(name: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "integer"}}


@lru_cache(maxsize=1)
def openapi_spec() -> dict:
    config_schema = RunConfig.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = config_schema.pop("$defs", {})
    _, responses = models_json_schema([(m, "serialization") for m in RESPONSE_MODELS],
                                      ref_template="#/components/schemas/{model}")
    response_schemas = responses.get("$defs", {})
    for schema in response_schemas.values():  # stored configs have RunConfig's shape
        for name, prop in schema.get("properties", {}).items():
            if prop.get("x-schema") == "RunConfig":
                schema["properties"][name] = {"$ref": "#/components/schemas/RunConfig"}
    err = _json("#/components/schemas/Error", "error")
    run = _json("#/components/schemas/Run", "the run")
    return {
        "openapi": "3.1.0",
        "info": {"title": "Turnstile API", "version": "1.0.0",
                 "description": "Drive and watch GRPO training runs of unmodified coding agents."},
        "paths": {
            "/api/health": {"get": {"summary": "Liveness of the API process.",
                                    "responses": {"200": _json("#/components/schemas/Health", "ok")}}},
            "/api/openapi.json": {"get": {"summary": "This document.",
                                          "responses": {"200": {"description": "OpenAPI 3.1 document"}}}},
            "/api/runs": {
                "post": {
                    "summary": "Create a run (train, eval or collect); it is queued and started by the control queue.",
                    "parameters": [{"name": "dry_run", "in": "query", "schema": {"type": "string", "enum": ["1", "0", "true", "false"]},
                                    "description": "1: check the config and the labels (every problem in one 400) and answer "
                                                   "200 with the config and each setting's source; no run is created"}],
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RunConfig"}}}},
                    "responses": {"202": run, "200": {"description": "dry_run: the checked config and its provenance"}, "400": err},
                },
                "get": {"summary": "List runs, newest first; `q` searches name, notes and tags (any case), `tag` "
                                   "(repeated or comma-separated) keeps runs with every tag given.",
                        "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "maximum": 500}}]
                                      + [{"name": n, "in": "query", "schema": {"type": "string"}}
                                         for n in ("q", "tag", "kind", "status")],
                        "responses": {"200": _json("#/components/schemas/RunList", "runs")}},
            },
            "/api/runs/{run_id}": {"get": {"summary": "One run with its episode counts and training steps.",
                                           "parameters": [_id_param("run_id")], "responses": {"200": run, "404": err}},
                                   "patch": {"summary": "Set or clear the run's name, tags and notes (at any time, "
                                                        "also once it ended); every problem of the body in one 400.",
                                             "parameters": [_id_param("run_id")],
                                             "requestBody": {"required": True, "content": {"application/json": {"schema": _LABELS}}},
                                             "responses": {"200": run, "400": err, "404": err}}},
            "/api/runs/{run_id}/cancel": {"post": {"summary": "Cancel a run: running episodes are stopped, nothing recorded is lost.",
                                                   "parameters": [_id_param("run_id")], "responses": {"202": run, "404": err, "409": err}}},
            "/api/runs/{run_id}/metrics": {"get": {"summary": "The run's per-step metrics (completed steps), one column per recorded metric "
                                                               "(nested keys dotted); a metric a step did not record is null / empty, never 0.",
                                                    "parameters": [_id_param("run_id"),
                                                                   {"name": "format", "in": "query", "schema": {"type": "string", "enum": ["json", "csv"], "default": "json"}}],
                                                    "responses": {"200": {"description": "JSON {run_id, columns, steps: [{column: value}]}, or CSV with a header row",
                                                                          "content": {"application/json": {"schema": {"type": "object"}},
                                                                                      "text/csv": {"schema": {"type": "string"}}}},
                                                                  "400": err, "404": err}}},
            "/api/runs/{run_id}/episodes": {"get": {"summary": "Episodes of a run.",
                                                    "parameters": [_id_param("run_id"), {"name": "status", "in": "query", "schema": {"type": "string"}}],
                                                    "responses": {"200": _json("#/components/schemas/EpisodeList", "episodes"), "404": err}}},
            "/api/episodes/{episode_id}": {"get": {"summary": "One episode with its completions (token ids and logprobs).",
                                                   "parameters": [_id_param("episode_id")], "responses": {"200": _json("#/components/schemas/Episode", "the episode"), "404": err}}},
            "/api/runs/{run_id}/export": {"get": {"summary": "Stream the run's episodes, completions and trajectories as JSON lines.",
                                                  "parameters": [_id_param("run_id")],
                                                  "description": "One `ExportLine` per episode, as it is read.  Completions and trajectories give the "
                                                                 "policy version of every token (`token_policy_versions`) and, where recorded, "
                                                                 "the KV version (`token_kv_versions`).",
                                                  # JSONL has no schema of its own in OpenAPI 3.1 (3.2's `itemSchema`): each line's is named here
                                                  "responses": {"200": {"description": "JSONL, one `ExportLine` per line", "content": {"application/x-ndjson": {
                                                      "schema": {"type": "string"}, "x-line-schema": {"$ref": "#/components/schemas/ExportLine"}}}},
                                                      "404": err}}},
            "/api/compare": {"get": {"summary": "pass@1 of two eval runs side by side with the paired difference; a pair that "
                                                "cannot be compared (not completed, not an eval, different instances, "
                                                "instances the train run saw) is a 400 naming each reason, unless force=1.",
                                     "parameters": [{"name": n, "in": "query", "required": True, "schema": {"type": "integer"}}
                                                    for n in ("a", "b")]
                                                   + [{"name": "force", "in": "query", "schema": {"type": "string"},
                                                       "description": "1 (or true, yes) compares a refused pair, with a warning per mismatch"}],
                                     "responses": {"200": {"description": "the comparison, with `warnings` and `held_out`"},
                                                   "400": err, "404": err}}},
            "/api/runs/{a}/diff/{b}": {"get": {"summary": "The config diff of two runs: dotted keys that differ, each added, removed or changed.",
                                               "parameters": [_id_param("a"), _id_param("b")],
                                               "responses": {"200": {"description": "{a, b, diff: [{key, change, a, b}]}"}, "404": err}}},
        },
        "components": {
            "schemas": {
                **defs,
                "RunConfig": config_schema,
                "Error": _ERROR,
                **response_schemas,
            }
        },
    }
