"""Find a proposer by name: the `specserve.proposers` entry-point group, or `package.module:Class`.

The built-ins (ngram, draft_model, medusa) are entry points too, declared once in pyproject.toml, so
the engine names no plugin module and never imports specserve.plugins. A third-party entry point may
add names but never shadows one of ours: on a clash the specserve distribution's entry wins.

This module imports no torch (proposer.py is imported only to build one): EngineConfig.validate checks
the method names here, so a misspelt `--speculative-method` is a usage error before any model loads.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .proposer import Proposer, ProposerContext

ENTRY_POINT_GROUP = "specserve.proposers"
_OWN_DISTRIBUTION = "specserve"


class ProposerError(ValueError):
    """A proposer cannot be built (bad name, bad path, incompatible draft): a start-up error.

    Defined here, torch-free, for check_method_names; importable from specserve.engine.proposer."""


def _is_ours(ep: EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name == _OWN_DISTRIBUTION


def available_proposers() -> dict[str, str]:
    """name -> "module:attr" for every installed proposer (ours override same-named third-party ones)."""
    found: dict[str, str] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=_is_ours):
        found[ep.name] = ep.value  # ours sort last, so they win a clash
    return found


def _unknown_method(name: str, known: dict[str, str]) -> ProposerError:
    return ProposerError(
        f"unknown speculative method {name!r}; choose auto, none, {', '.join(sorted(known))}"
        " or package.module:Class"
    )


def check_method_names(names: list[str]) -> None:
    """Raise ProposerError for a name that is neither auto, none, an installed proposer nor
    package.module:Class (that one is imported only when the engine builds it)."""
    known: dict[str, str] | None = None
    for name in names:
        if name in ("auto", "none") or ":" in name:
            continue
        known = available_proposers() if known is None else known
        if name not in known:
            raise _unknown_method(name, known)


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
    from .proposer import Proposer

    known = available_proposers()
    if name in known:
        cls = _import(known[name])
    elif ":" in name:
        cls = _import(name)
    else:
        raise _unknown_method(name, known)
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise ProposerError(
            f"{name!r} is not a proposer: subclass specserve.engine.proposer.Proposer (see docs/plugins.md)"
        )
    return cls(ctx)
