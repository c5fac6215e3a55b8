"""OpenAI-shaped HTTP errors."""

from __future__ import annotations

from aiohttp import web

from .protocol import error_body

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> web.Response:
    return web.json_response(
        error_body(message, _TYPES.get(status, "invalid_request_error"), param, code), status=status
    )


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.param, self.code)
