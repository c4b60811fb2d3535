"""No import cycle anywhere in the package: every ``import`` and ``from ... import`` of every module (inside
functions too, and a module importing its own package's ``__init__``) is an edge, and the graph must be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

ROOTS = ("hf_sparsekv", "hf_sparsekv_cli")
REPO = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports. ``from a.b import c`` imports the module ``a.b.c`` where that is one,
    else the name ``c`` from ``a.b`` (its ``__init__`` when it is a package); packages on the way are imported
    first, except the importing module's own ancestors, which are already being imported (importing a name from one
    of them does count: that is a module importing its own package's ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in modules else module)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            ancestor = name.startswith(prefix + ".")
            if prefix in modules and prefix != name and (not ancestor or prefix == target):
                edges.add(prefix)
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["hf_sparsekv.generation.front"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_walk_finds_a_cycle():
    """The check itself: a two-module cycle and one through a package ``__init__`` are found."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"p.y"}, "p.y": {"p"}}) is not None
    assert _cycle({"a": {"b"}, "b": set()}) is None
