"""Find a proposer by name: built-ins, the `specserve.proposers` entry-point group, or `pkg.module:Class`."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from specserve.engine.proposer import Proposer, ProposerContext, ProposerError

ENTRY_POINT_GROUP = "specserve.proposers"
BUILTIN_PROPOSERS = {
    "ngram": "specserve.plugins.ngram:NgramProposer",
    "draft_model": "specserve.plugins.draft_model:DraftModelProposer",
    "medusa": "specserve.plugins.medusa:MedusaProposer",
}


def available_proposers() -> dict[str, str]:
    """name -> "module:attr"; installed entry points may add names but never shadow built-ins."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.update(BUILTIN_PROPOSERS)
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
    proposer = cls(ctx)
    if not isinstance(proposer, Proposer):
        raise ProposerError(
            f"{name!r} does not implement the Proposer protocol (name, needs_hidden_states, propose)"
        )
    return proposer
