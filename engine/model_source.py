"""Telling a hub id from a local path, without torch: the CLI refuses a --model-path that is neither
before it imports the engine (seconds), and the loader (engine/models/loader.py) refuses it the same way."""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def not_a_model_message(model_path: str) -> str:
    return f"model path {model_path!r} does not exist and is not a hub id (org/name)"


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name


def unknown_model_path(model_path: str) -> str | None:
    """Why `model_path` (a model without a separate weight path) names no model: it does not exist
    and is not a hub id. None when it exists or may be a hub id."""
    if Path(model_path).expanduser().exists() or looks_like_hub_id(model_path):
        return None
    return not_a_model_message(model_path)
