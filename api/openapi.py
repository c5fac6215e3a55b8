"""The server's OpenAPI 3.1 document, built from the same pydantic models that validate requests."""

from __future__ import annotations

from typing import Any

from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

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


_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}
_TOKENIZE_RESPONSE = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
    },
}
_DETOKENIZE_RESPONSE = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
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


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _tokenize_paths(components: dict[str, Any]) -> dict[str, Any]:
    for model in (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest):
        schema, defs = _schema(model)
        components.update(defs)
        components[model.__name__] = schema
    components["TokenizeResponse"] = _TOKENIZE_RESPONSE
    components["DetokenizeResponse"] = _DETOKENIZE_RESPONSE
    request_errors = _errors(400, 401, 404, 408, 413, 415)
    tokenize_body = {"oneOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}
    return {
        "/tokenize": {
            "post": {
                "summary": "Token ids of a prompt, or of chat messages rendered with the chat template",
                "operationId": "Tokenize",
                "requestBody": {"required": True, **_json(tokenize_body)},
                "responses": {
                    "200": {"description": "the token ids", **_json(_ref("TokenizeResponse"))},
                    **request_errors,
                },
            }
        },
        "/detokenize": {
            "post": {
                "summary": "The text of a list of token ids",
                "operationId": "Detokenize",
                "requestBody": {"required": True, **_json(_ref("DetokenizeRequest"))},
                "responses": {
                    "200": {"description": "the text", **_json(_ref("DetokenizeResponse"))},
                    **request_errors,
                },
            }
        },
    }


def openapi_document(version: str) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": _ERROR, "Model": _MODEL}
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
    paths["/v1/models/{model_id}"] = {
        "get": {
            "summary": "One served model (its id may contain '/')",
            "operationId": "RetrieveModel",
            "parameters": [
                {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {"200": {"description": "the model", **_json(_ref("Model"))}, **_errors(401, 404)},
        }
    }
    paths.update(_tokenize_paths(components))
    return {
        "openapi": "3.1.0",
        "info": {"title": "specserve", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
