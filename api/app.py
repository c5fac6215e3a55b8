"""The aiohttp application: middleware (request ids and access log, errors, auth), routes, OpenAPI
document."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from specserve import __version__
from specserve.engine.async_engine import AsyncEngine

from .errors import ApiError, error_response
from .field_policy import CHAT_FIELDS, COMPLETION_FIELDS, EndpointFields, IgnoredFieldLog
from .logs import access_middleware, add_request_id_header
from .metrics import CONTENT_TYPE, MetricsExporter
from .openai_serving import OpenAIServing
from .openapi import openapi_document
from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenization import DETOKENIZE_FIELDS, DetokenizeRequest, Tokenization, check_model, tokenize_variant

logger = logging.getLogger("specserve.api")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
SERVING_KEY = web.AppKey("serving", OpenAIServing)
METRICS_KEY = web.AppKey("metrics", MetricsExporter)
OPTIONS_KEY = web.AppKey("options", dict)
TOKENIZATION_KEY = web.AppKey("tokenization", Tokenization)
IGNORED_FIELDS_KEY = web.AppKey("ignored_fields", IgnoredFieldLog)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 413 else "request body too large"
        return error_response(exc.status, f"{message} ({request.method} {request.path})")
    except asyncio.CancelledError:
        raise
    except ConnectionError:
        # The client hung up while we wrote headers or a chunk, before aiohttp's handler cancellation
        # reached us: the generation was already aborted in the handler's cleanup, nothing failed here.
        logger.debug("client disconnected during %s %s", request.method, request.path)
        return web.Response(status=499, reason="Client Closed Request")
    except Exception:
        logger.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal server error", code="internal_error")


def auth_middleware(api_key: str | None, open_paths: set[str]):
    expected = f"Bearer {api_key}".encode() if api_key else b""

    @web.middleware
    async def check(request: web.Request, handler):
        if api_key and request.path not in open_paths:
            given = request.headers.get("Authorization", "").encode()
            # Constant-time comparison: timing must not reveal how much of the key matched.
            if not hmac.compare_digest(given, expected):
                return error_response(401, "missing or invalid API key", code="invalid_api_key")
        return await handler(request)

    return check


async def _read_body(request: web.Request) -> dict[str, Any]:
    timeout = request.app[OPTIONS_KEY]["read_timeout"]
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s") from None
    except ConnectionError:  # the client hung up mid-body: its problem, not an internal error
        raise ApiError(400, "the connection closed before the request body was complete") from None
    # JSON only: a browser page can POST text/plain or a form cross-site without a CORS preflight.
    if request.content_type != "application/json" and not request.content_type.endswith("+json"):
        raise ApiError(415, f"Content-Type must be application/json, not {request.content_type[:100]!r}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ApiError(400, f"invalid JSON body: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        # JSON can escape a lone UTF-16 surrogate, which is no Unicode text: tokenizers fail on it later.
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff)") from None
    return data


def _validate(
    request: web.Request, data: dict[str, Any], model: type[BaseModel], fields: EndpointFields
) -> Any:
    """Refused fields first (a 400 naming them), then the model; fields with no effect are logged."""
    ignored = fields.check(data)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    request.app[IGNORED_FIELDS_KEY].warn(request.path, ignored)
    return body


async def _read_json(request: web.Request, model: type[BaseModel], fields: EndpointFields) -> Any:
    return _validate(request, await _read_body(request), model, fields)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request, ChatCompletionRequest, CHAT_FIELDS)
    return await request.app[SERVING_KEY].chat(request, body)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request, CompletionRequest, COMPLETION_FIELDS)
    return await request.app[SERVING_KEY].completions(request, body)


async def tokenize(request: web.Request) -> web.Response:
    data = await _read_body(request)
    model, fields = tokenize_variant(data)
    body = _validate(request, data, model, fields)
    return web.json_response(request.app[TOKENIZATION_KEY].tokenize(body))


async def detokenize(request: web.Request) -> web.Response:
    body = await _read_json(request, DetokenizeRequest, DETOKENIZE_FIELDS)
    return web.json_response(request.app[TOKENIZATION_KEY].detokenize(body))


def _model_card(request: web.Request) -> dict[str, Any]:
    return {
        "id": request.app[SERVING_KEY].model_name,
        "object": "model",
        "created": request.app[OPTIONS_KEY]["started"],
        "owned_by": "specserve",
    }


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def model(request: web.Request) -> web.Response:
    check_model(request.match_info["model_id"], request.app[SERVING_KEY].model_name)
    return web.json_response(_model_card(request))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.alive and not request.app[SERVING_KEY].draining:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable"}, status=503)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    exporter = request.app[METRICS_KEY]
    exporter.update(request.app[ENGINE_KEY].snapshot())
    return web.Response(body=exporter.render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(__version__))


def build_app(
    engine: AsyncEngine,
    model_name: str,
    *,
    api_key: str | None = None,
    open_paths: set[str] | None = None,
    max_request_bytes: int = 1 << 20,
    max_waiting: int = 256,
    read_timeout: float = 30.0,
    log_stats_interval: float = 10.0,
    access_log: bool = True,
    max_model_len: int,  # the engine's max sequence length (prompt + output), for /tokenize
    tool_call_parser: str = "auto",
) -> web.Application:
    app = web.Application(
        middlewares=[
            access_middleware(access_log),  # outermost: request id first, access line with the final status
            error_middleware,
            auth_middleware(api_key, open_paths or {"/health", "/metrics"}),
        ],
        client_max_size=max_request_bytes,
    )
    app.on_response_prepare.append(add_request_id_header)
    exporter = MetricsExporter(model_name, engine.snapshot())
    app[ENGINE_KEY] = engine
    app[SERVING_KEY] = OpenAIServing(engine, model_name, engine.tokenizer, max_waiting, tool_call_parser)
    app[METRICS_KEY] = exporter
    app[OPTIONS_KEY] = {"read_timeout": read_timeout, "started": int(time.time())}
    app[TOKENIZATION_KEY] = Tokenization(engine.tokenizer, model_name, max_model_len)
    app[IGNORED_FIELDS_KEY] = IgnoredFieldLog()

    def on_step() -> None:
        snapshot = engine.snapshot()
        exporter.update(snapshot)
        exporter.maybe_log(snapshot, log_stats_interval)

    engine.on_step = on_step
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)  # ids may hold '/': Qwen/Qwen2.5-Coder-1.5B
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
