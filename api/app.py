"""The aiohttp application: middleware (request ids and access log, errors, auth), routes, OpenAPI
document."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from specserve import __version__
from specserve.engine.async_engine import AsyncEngine

from .errors import ApiError, error_response
from .logs import access_middleware, add_request_id_header
from .metrics import CONTENT_TYPE, MetricsExporter
from .openai_serving import OpenAIServing
from .openapi import openapi_document
from .protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("specserve.api")

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
SERVING_KEY = web.AppKey("serving", OpenAIServing)
METRICS_KEY = web.AppKey("metrics", MetricsExporter)
OPTIONS_KEY = web.AppKey("options", dict)


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


async def _read_json(request: web.Request, model: type[BaseModel]) -> Any:
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
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request, ChatCompletionRequest)
    return await request.app[SERVING_KEY].chat(request, body)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request, CompletionRequest)
    return await request.app[SERVING_KEY].completions(request, body)


async def models(request: web.Request) -> web.Response:
    serving = request.app[SERVING_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": serving.model_name,
                    "object": "model",
                    "created": request.app[OPTIONS_KEY]["started"],
                    "owned_by": "specserve",
                }
            ],
        }
    )


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
    app[SERVING_KEY] = OpenAIServing(engine, model_name, engine.tokenizer, max_waiting)
    app[METRICS_KEY] = exporter
    app[OPTIONS_KEY] = {"read_timeout": read_timeout, "started": int(time.time())}

    def on_step() -> None:
        snapshot = engine.snapshot()
        exporter.update(snapshot)
        exporter.maybe_log(snapshot, log_stats_interval)

    engine.on_step = on_step
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
