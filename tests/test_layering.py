"""The package's layering, checked from the source (ast), so a violation fails before anyone runs it.

engine/ is the bottom layer (it knows no server and no plugin), api/ and plugins/ sit on it; the
scheduler and KV bookkeeping are pure Python; Prometheus stays behind api/metrics.py; the API reads
the engine through AsyncEngine and its snapshots, never through the core's internals. Imports inside
functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "api", "plugins")  # installed as specserve.engine, specserve.api, specserve.plugins
PURE_PYTHON = (
    "engine.scheduler",
    "engine.spec_controller",
    "engine.acceptance_model",
    "engine.step_cost_model",
    "engine.catch_up_payback",
    "engine.kv_cache_manager",
    "engine.block_pool",
    "engine.request",
)
# What the API may not reach into: the core behind AsyncEngine and the core's parts.
ENGINE_INTERNALS = {"core", "kv_manager", "scheduler"}


def _module_name(path: Path) -> str:
    """engine/models/loader.py -> specserve.engine.models.loader (a package's __init__ -> the package)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["specserve", *parts])


@cache
def _sources() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_sources()[module].read_text(), str(_sources()[module]))


@cache
def imports(module: str) -> frozenset[str]:
    """Every module `module` imports anywhere in its body, relative imports made absolute."""
    path = _sources()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from . import x` / `from pkg import module`: the name may itself be a module.
            found.update(
                f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in _sources()
            )
    return frozenset(found)


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _modules_of(package: str) -> list[str]:
    return [m for m in _sources() if _in_package(m, f"specserve.{package}")]


def test_the_source_tree_is_found():
    assert {"specserve.engine.engine_core", "specserve.api.metrics", "specserve.plugins.ngram"} <= set(
        _sources()
    )
    assert "specserve.engine.stats" in imports("specserve.engine.engine_core")
    assert "torch" in imports("specserve.engine.engine_core")


@pytest.mark.parametrize("module", _modules_of("engine"))
def test_engine_imports_neither_api_nor_plugins(module):
    bad = {
        name
        for name in imports(module)
        if _in_package(name, "specserve.api") or _in_package(name, "specserve.plugins")
    }
    assert not bad, f"{module} imports {sorted(bad)}: the engine must not depend on the server or a plugin"


@pytest.mark.parametrize("module", [f"specserve.{m}" for m in PURE_PYTHON])
def test_scheduling_and_kv_bookkeeping_never_import_torch(module):
    """Directly or through another specserve module (package __init__s aside: they are not the code's
    dependencies, only the import system's)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        assert not any(_in_package(name, "torch") for name in imports(current)), (
            f"{module} pulls in torch through {current}"
        )
        todo += [
            name for name in imports(current) if name in _sources() and _sources()[name].name != "__init__.py"
        ]


def test_only_api_metrics_imports_prometheus_client():
    importers = {m for m in _sources() if any(_in_package(n, "prometheus_client") for n in imports(m))}
    assert importers == {"specserve.api.metrics"}


def test_api_modules_import_each_other_without_cycles():
    graph = {
        m: {n for n in imports(m) if n in _sources() and _in_package(n, "specserve.api")}
        for m in _modules_of("api")
    }
    visiting, done = [], set()

    def visit(module: str) -> None:
        if module in done:
            return
        assert module not in visiting, "import cycle: " + " -> ".join(
            [*visiting[visiting.index(module) :], module]
        )
        visiting.append(module)
        for name in sorted(graph[module]):
            visit(name)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("module", _modules_of("api"))
def test_api_reads_the_engine_only_through_async_engine(module):
    """No `x.core`, `x.kv_manager` or `x.scheduler` in api/: AsyncEngine and EngineSnapshot carry all it needs."""
    reached = sorted(
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
    )
    assert not reached, f"{module} reaches into the engine: {reached}"


def test_the_cli_parses_flags_before_it_imports_torch():
    """A usage error must not wait for torch and transformers (~4.5 s here): the CLI module and the
    settings it builds import neither; they come with the engine, after the flags are checked."""
    import subprocess
    import sys

    code = "import sys, specserve.api.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
