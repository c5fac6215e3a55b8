"""Logging for the CLI and the server: `--log-level`, `--log-format text|json`, the access log and request
ids.

JSON is one object per line on stderr: `time`, `level`, `logger`, `message`, the request's `request_id`
when the line was logged while serving one, and for access lines `method`, `route`, `status`,
`latency_s`, `prompt_tokens`, `completion_tokens` and `remote`. Nothing logs prompt or completion text.
A request's id is its `X-Request-Id` header when the client sends a sane one (printable, at most 128
characters), else a fresh one; the response carries it back in `X-Request-Id`.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import sys
import time
import uuid
from typing import Any

from aiohttp import web

from .flags import LOG_FORMATS, LOG_LEVELS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_KEY = "specserve.request_id"
USAGE_KEY = "specserve.usage"  # {"prompt_tokens": n, "completion_tokens": n}, set by the OpenAI handlers
ACCESS_LOGGER = "specserve.access"
# Health probes and scrapes arrive every few seconds: their access lines are DEBUG, the rest INFO.
QUIET_PATHS = frozenset({"/health", "/metrics"})
# Access-line fields, in order; the text format prints them as key=value after the request line.
ACCESS_FIELDS = ("request_id", "method", "route", "status", "latency_s", "prompt_tokens", "completion_tokens")

_SANE_ID = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces: safe to echo in a header and a log
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "specserve_request_id", default=None
)


class RequestIdFilter(logging.Filter):
    """Stamps every record with the id of the request being served in this task (None outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if getattr(record, "request_id", None) is not None:
            entry["request_id"] = record.request_id
        for key in ACCESS_FIELDS[1:] + ("remote",):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def parse_choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    """The lower-cased value, or ValueError naming the flag (environment values skip argparse)."""
    lowered = str(value).strip().lower()
    if lowered not in choices:
        raise ValueError(f"{flag}: {value!r} is not one of {', '.join(choices)}")
    return lowered


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """One stderr handler on the root logger, replacing any earlier set-up."""
    level = parse_choice("--log-level", level, LOG_LEVELS)
    fmt = parse_choice("--log-format", fmt, LOG_FORMATS)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def request_id_from(request: web.BaseRequest) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex


def _route(request: web.Request) -> str:
    """The matched route's pattern (bounded), else the path cut short: unmatched paths are the client's."""
    info = request.match_info
    resource = info.route.resource if info is not None and info.route is not None else None
    canonical = resource.canonical if resource is not None else ""
    return canonical or request.path[:200]


def access_middleware(enabled: bool):
    """Outermost middleware: assigns the request id, then logs one access line with the final status."""
    access = logging.getLogger(ACCESS_LOGGER)

    @web.middleware
    async def handle(request: web.Request, handler):
        rid = request_id_from(request)
        request[REQUEST_ID_KEY] = rid
        token = current_request_id.set(rid)
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:  # a cancelled handler: the client went away first
            status = 499
            raise
        finally:
            current_request_id.reset(token)
            if enabled:
                _log_access(access, request, rid, status, time.perf_counter() - start)

    return handle


def _log_access(access: logging.Logger, request: web.Request, rid: str, status: int, seconds: float) -> None:
    level = logging.DEBUG if request.path in QUIET_PATHS and status < 400 else logging.INFO
    if not access.isEnabledFor(level):
        return
    usage = request.get(USAGE_KEY) or {}
    fields: dict[str, Any] = {
        "request_id": rid,
        "method": request.method,
        "route": _route(request),
        "status": status,
        "latency_s": round(seconds, 4),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "remote": request.remote,
    }
    extras = " ".join(f"{k}={fields[k]}" for k in ACCESS_FIELDS[3:] if fields[k] is not None)
    access.log(
        level,
        '%s "%s %s" %s request_id=%s',
        fields["remote"],
        fields["method"],
        fields["route"],
        extras,
        rid,
        extra=fields,
    )


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response, streamed ones included, carries the request's id."""
    rid = request.get(REQUEST_ID_KEY)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid
