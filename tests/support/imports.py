"""The project's imports as a graph of modules (networkx), read from the source: every import,
those inside functions and under TYPE_CHECKING too (they hide a circle, they do not remove one).
What the layout test checks against it: the packages' order, and no circle of modules."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> nx.DiGraph:
    """An edge from each module to each project module it imports. `from a.b import c` names the
    module a.b.c when there is one; a module's import of its own package (`__init__`) is no edge."""
    files = {module_name(root, p): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    raise ValueError(f"{path}:{node.lineno}: a relative import (the project imports absolutely)")
                base = node.module or ""
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    graph.add_edge(module, name, line=node.lineno)
    return graph


def against_order(graph: nx.DiGraph, order: tuple[str, ...]) -> list[str]:
    """Imports of a higher room from a lower one, as "module:line imports module". A module's room
    is the first of `order` (packages or modules, lowest first) that is it or holds it; imports
    from or to a module of no room are not judged."""

    def room(module: str) -> int | None:
        return next((i for i, r in enumerate(order) if module == r or module.startswith(r + ".")), None)

    return sorted(
        f"{a}:{data['line']} imports {b}"
        for a, b, data in graph.edges(data=True)
        if (low := room(a)) is not None and (high := room(b)) is not None and high > low
    )


def circles(graph: nx.DiGraph) -> list[list[str]]:
    """Each set of modules that import each other, directly or round a loop."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
