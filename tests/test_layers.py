"""The package's import graph: layers run downwards, with no circles, and sans-IO stays sans-IO.

The layers are the ones ``docs/architecture.md`` ("Layers") draws; this test reads every
module's imports (type-only and function-level ones included) with ``ast``, so an import
that runs against the layers, or a circle of imports, fails here before it spreads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "epd_actors"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__", "program", "testing", "bench"),
    ("discovery",),
    ("frontends",),
    ("core",),
    ("backends",),
    ("simulator",),
    ("kv_events",),
    ("worker",),
    ("openai",),
    ("http",),
    ("transport",),
    ("request",),
    ("protocol",),
    (
        "handoff",
        "config_tables",
        "trace_context",
        "lora",
        "addresses",
        "logs",
        "limits",
        "_groups",
        "errors",
        "records",
    ),
)
"""Top to bottom: a module may import its own layer's modules and any layer below."""

SANS_IO = {"protocol": ("trio", "httpx", "socket"), "openai": ("trio", "httpx", "socket")}
"""Packages that must not import these (they take their I/O from the caller)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (resolved to modules that exist)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = package[: len(package) - node.level + 1]
                    base = ".".join([*prefix, *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target.startswith("epd_actors.") and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[1]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of LAYERS")


GRAPH = _imports()


def test_every_module_belongs_to_a_layer() -> None:
    assert len(GRAPH) > 50, f"read only {len(GRAPH)} modules under {PACKAGE}"
    for module in GRAPH:
        if module != "epd_actors":
            _layer(module)


def test_imports_run_down_the_layers() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if module != "epd_actors"
        for target in targets
        if _layer(target) < _layer(module)
    ]
    assert upward == []


def test_there_is_no_circle_of_imports() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert circles == []


@pytest.mark.parametrize("package", sorted(SANS_IO))
def test_sans_io_packages_do_no_io(package: str) -> None:
    banned = SANS_IO[package]
    offenders = []
    for path in (PACKAGE / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in banned]
    assert offenders == []


def test_the_worker_never_imports_the_router() -> None:
    router_side = {"frontends", "core", "backends", "discovery", "program"}
    wrong = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if module.startswith("epd_actors.worker")
        for target in targets
        if target.split(".")[1] in router_side
    ]
    assert wrong == []
