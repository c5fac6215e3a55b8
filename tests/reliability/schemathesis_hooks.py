"""Schemathesis hooks for the fuzz test: an extra check that every error body is OpenAI-shaped.

Loaded by `st run` through SCHEMATHESIS_HOOKS=schemathesis_hooks (this directory on PYTHONPATH).
"""

from __future__ import annotations

import json

import schemathesis


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """Any 4xx/5xx body is exactly {"error": {"message", "type", "param", "code"}} with a message."""
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from None
    if not isinstance(body, dict) or set(body) != {"error"}:
        raise AssertionError(f"error body is not {{'error': ...}}: {str(body)[:200]}")
    err = body["error"]
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        raise AssertionError(f"error object lacks message/type/param/code: {str(err)[:200]}")
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        raise AssertionError(f"error message/type must be non-empty strings: {str(err)[:200]}")
    return None
