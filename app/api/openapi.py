"""OpenAPI 3.1 document for the REST API, served at /api/openapi.json.

The run-config schema is generated from the pydantic model, so the document and
the validation can never disagree.
"""
from __future__ import annotations

from functools import lru_cache

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


def _json(schema_ref: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": schema_ref}}}}


def _id_param(name: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "integer"}}


@lru_cache(maxsize=1)
def openapi_spec() -> dict:
    config_schema = RunConfig.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = config_schema.pop("$defs", {})
    err = _json("#/components/schemas/Error", "error")
    run = _json("#/components/schemas/Run", "the run")
    return {
        "openapi": "3.1.0",
        "info": {"title": "Turnstile API", "version": "1.0.0",
                 "description": "Drive and watch GRPO training runs of unmodified coding agents."},
        "paths": {
            "/api/runs": {
                "post": {
                    "summary": "Create a run (train, eval or collect); it is queued and started by the control queue.",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RunConfig"}}}},
                    "responses": {"202": run, "400": err},
                },
                "get": {"summary": "List runs, newest first.",
                        "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "maximum": 500}}],
                        "responses": {"200": {"description": "runs", "content": {"application/json": {"schema": {"type": "object", "properties": {"runs": {"type": "array", "items": {"$ref": "#/components/schemas/Run"}}}}}}}}},
            },
            "/api/runs/{run_id}": {"get": {"summary": "One run with its episode counts and training steps.",
                                           "parameters": [_id_param("run_id")], "responses": {"200": run, "404": err}}},
            "/api/runs/{run_id}/cancel": {"post": {"summary": "Cancel a run: running episodes are stopped, nothing recorded is lost.",
                                                   "parameters": [_id_param("run_id")], "responses": {"202": run, "404": err, "409": err}}},
            "/api/runs/{run_id}/episodes": {"get": {"summary": "Episodes of a run.",
                                                    "parameters": [_id_param("run_id"), {"name": "status", "in": "query", "schema": {"type": "string"}}],
                                                    "responses": {"200": {"description": "episodes", "content": {"application/json": {"schema": {"type": "object", "properties": {"episodes": {"type": "array", "items": {"$ref": "#/components/schemas/Episode"}}}}}}}, "404": err}}},
            "/api/episodes/{episode_id}": {"get": {"summary": "One episode with its completions (token ids and logprobs).",
                                                   "parameters": [_id_param("episode_id")], "responses": {"200": _json("#/components/schemas/Episode", "the episode"), "404": err}}},
            "/api/runs/{run_id}/export": {"get": {"summary": "Stream the run's episodes, completions and trajectories as JSON lines.",
                                                  "parameters": [_id_param("run_id")],
                                                  "responses": {"200": {"description": "JSONL", "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}, "404": err}}},
        },
        "components": {
            "schemas": {
                **defs,
                "RunConfig": config_schema,
                "Error": _ERROR,
                "Run": {"type": "object", "properties": {
                    "id": {"type": "integer"}, "kind": {"type": "string", "enum": ["train", "eval", "collect"]},
                    "status": {"type": "string", "enum": ["queued", "running", "cancelling", "completed", "failed", "cancelled"]},
                    "policy_version": {"type": "integer"}, "config": {"$ref": "#/components/schemas/RunConfig"},
                    "episodes_by_status": {"type": "object", "additionalProperties": {"type": "integer"}},
                    "steps": {"type": "array", "items": {"type": "object"}},
                    "summary": {"type": ["object", "null"]}, "error": {"type": ["string", "null"]}},
                    "required": ["id", "kind", "status"]},
                "Episode": {"type": "object", "properties": {
                    "id": {"type": "integer"}, "run_id": {"type": "integer"}, "instance_id": {"type": "string"},
                    "status": {"type": "string"}, "reward": {"type": ["number", "null"]},
                    "resolved": {"type": ["boolean", "null"]}, "patch": {"type": ["string", "null"]},
                    "completions": {"type": "array", "items": {"type": "object"}}},
                    "required": ["id", "run_id", "status"]},
            }
        },
    }
