"""Find a proposer by name: the `specserve.proposers` entry-point group, or `package.module:Class`.

The built-ins (ngram, draft_model, medusa) are entry points too, declared once in pyproject.toml, so
the engine names no plugin module and never imports specserve.plugins. A third-party entry point may
add names but never shadows one of ours: on a clash the specserve distribution's entry wins.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

from .proposer import Proposer, ProposerContext, ProposerError

ENTRY_POINT_GROUP = "specserve.proposers"
_OWN_DISTRIBUTION = "specserve"


def _is_ours(ep: EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name == _OWN_DISTRIBUTION


def available_proposers() -> dict[str, str]:
    """name -> "module:attr" for every installed proposer (ours override same-named third-party ones)."""
    found: dict[str, str] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=_is_ours):
        found[ep.name] = ep.value  # ours sort last, so they win a clash
    return found


def _import(target: str) -> type:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProposerError(f"cannot import proposer module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ProposerError(f"module {module_name!r} has no proposer class {attr!r}") from exc


def load_proposer(name: str, ctx: ProposerContext) -> Proposer:
    known = available_proposers()
    if name in known:
        cls = _import(known[name])
    elif ":" in name:
        cls = _import(name)
    else:
        raise ProposerError(
            f"unknown speculative method {name!r}; choose auto, none, {', '.join(sorted(known))}"
            " or package.module:Class"
        )
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise ProposerError(
            f"{name!r} is not a proposer: subclass specserve.engine.proposer.Proposer (see docs/plugins.md)"
        )
    return cls(ctx)
