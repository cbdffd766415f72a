"""The import graph of tpserve's own packages: no cycles, and packages import only downward
(bench -> deployments -> workers -> scheduler -> metrics), as the README's layout section says.

Read from the source with `ast` (every import statement, at module level or inside a function or
a TYPE_CHECKING block), so a lazy import that hides a cycle at run time still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Highest first: a package may import those after it, never those before it.
LAYERS = ["bench", "deployments", "workers", "scheduler", "metrics"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (a `from pkg import mod` counts as pkg.mod where that is
    a module, else as pkg)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of nodes, or None (iterative DFS with colours)."""
    colour: dict[str, int] = {}
    for start in sorted(graph):
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not colour.get(child):
                colour[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def _collapse(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph between packages: each module named by its first `depth` components."""
    def key(name: str) -> str:
        return ".".join(name.split(".")[:depth])
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(key(name), set()).update(key(t) for t in targets if key(t) != key(name))
    return out


def test_no_module_import_cycle():
    assert _find_cycle(_graph()) is None


def test_no_cycle_between_subpackages():
    # workers.model -> workers.attention -> workers.cpu, and so on: no subpackage reaches back up.
    cycle = _find_cycle(_collapse(_graph(), 2))
    assert cycle is None, " -> ".join(cycle)


def test_packages_import_only_downward():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = sorted(
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for target in targets
        if rank[target.split(".")[0]] < rank[name.split(".")[0]]
    )
    assert upward == []


def test_the_checker_sees_a_cycle_and_an_upward_import():
    # The checks above would pass on an empty graph: this proves they can fail.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    graph = _graph()
    assert "workers.model.decoder" in graph and "workers.attention.paged" in graph["workers.model.decoder"]
    assert _collapse({"workers.a.x": {"workers.b.y"}, "workers.b.y": set()}, 2) == {"workers.a": {"workers.b"}, "workers.b": set()}
