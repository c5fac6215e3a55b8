"""The server's OpenAPI 3.1 document, built from the same pydantic models that validate requests."""

from __future__ import annotations

from typing import Any

from .protocol import ChatCompletionRequest, CompletionRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _schema(model) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return schema, defs


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(c): {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for c in codes
    }


def openapi_document(version: str) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": _ERROR}
    paths: dict[str, Any] = {}
    for path, model, summary in (
        ("/v1/chat/completions", ChatCompletionRequest, "Create a chat completion"),
        ("/v1/completions", CompletionRequest, "Create a text completion"),
    ):
        schema, defs = _schema(model)
        components.update(defs)
        components[model.__name__] = schema
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": model.__name__.removesuffix("Request"),
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                    },
                },
                "responses": {
                    "200": {
                        "description": "the completion (JSON, or Server-Sent Events when stream is true)",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {},
                        },
                    },
                    **_errors(400, 401, 404, 408, 413, 415, 503),
                },
            }
        }
    simple = {
        "/v1/models": "List served models",
        "/health": "200 while the engine loop is alive, 503 otherwise",
        "/version": "Server version",
        "/metrics": "Prometheus metrics",
    }
    for path, summary in simple.items():
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": "ok"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "specserve", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
