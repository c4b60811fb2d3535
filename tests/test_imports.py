"""No import cycles inside ``hf_sparsekv`` and ``hf_sparsekv_cli``: every ``.py`` file is parsed (not imported), its
imports collected (module level and inside functions), and the module graph searched for strongly connected
components.

What counts as importing a module: ``import a.b.c`` and ``from a.b.c import name`` import ``a.b.c`` and its parent
packages (``a``, ``a.b``) except those that already contain the importing module (they are initialised before it);
``from a.b import name`` also imports ``a.b.name`` where that is a submodule. A package named explicitly counts even
when it contains the importer, so ``from . import sibling`` imports this package's ``__init__`` as well as
``sibling``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hf_sparsekv", "hf_sparsekv_cli")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is the ``__init__`` of a package)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join(parts)] = (path, is_package)
    return modules


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The modules of this project that ``name`` imports, anywhere in its file."""
    own_package = name if is_package else name.rpartition(".")[0]
    already_running = {name, *_ancestors(name)}
    found = set()

    def add(target: str, explicit: bool) -> None:
        if target in modules and target != name and (explicit or target not in already_running):
            found.add(target)
        for parent in _ancestors(target):
            if parent in modules and parent not in already_running:
                found.add(parent)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, explicit=True)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            add(target, explicit=True)
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    add(f"{target}.{alias.name}", explicit=True)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _cycle_path(component: list[str], graph: dict[str, set[str]]) -> str:
    """One cycle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    previous, frontier = {start: None}, [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return " -> ".join(reversed(path)) + f" -> {start}"
            if child not in previous:
                previous[child] = node
                frontier.append(child)
    return ", ".join(component)


def test_the_resolver_sees_relative_and_function_level_imports():
    modules = _modules()
    assert {"hf_sparsekv", "hf_sparsekv.caches", "hf_sparsekv.caches.base", "hf_sparsekv_cli"} <= set(modules)
    graph = {name: _imports(name, *where, modules) for name, where in modules.items()}
    assert "hf_sparsekv.caches" in graph["hf_sparsekv"]
    assert "hf_sparsekv.generation.front" in graph["hf_sparsekv.generation"]
    assert "hf_sparsekv.training.run" in graph["hf_sparsekv.commands"]  # imported inside a function
    assert "hf_sparsekv.training" in graph["hf_sparsekv.commands"]  # the package it lives in runs first
    assert "hf_sparsekv" not in graph["hf_sparsekv.commands"]  # already running when hf_sparsekv.commands is imported
    assert "hf_sparsekv.caches" not in graph["hf_sparsekv.caches.static"]  # from .chunk_selection import ...
    # from . import runtime: the package named and the submodule
    assert {"hf_sparsekv.kernels", "hf_sparsekv.kernels.runtime"} <= graph["hf_sparsekv.kernels.chunk_attention"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, *where, modules) for name, where in modules.items()}
    cycles = [f"{', '.join(c)}\n  e.g. {_cycle_path(c, graph)}" for c in _cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
