"""The import graph of stagetrace's own modules, read from the source with ``ast``, and its cycles.

A test tool (``tests/test_imports.py``), not product code; also ``python -m tests.import_graph`` prints the graph's
size, its cycles and the arrows from outside ``collectors/`` into it.

Every import statement counts: at module level, inside functions, under ``if TYPE_CHECKING``. A cycle through a
function's import is still a loop the next developer has to keep in mind. What an import is an arrow to:

- ``import a.b`` and ``from a.b import C`` (C a name, not a module): to ``a.b``;
- ``from a import b`` where ``a.b`` is a module: to ``a.b`` alone. It reads the submodule, as ``import a.b`` does;
  the package ``a`` is initialised first in both cases, which is Python's rule for every submodule and no use of
  what ``a/__init__.py`` defines. Counting it would make every package that imports its own submodules a loop.

Only stagetrace's modules are nodes; imports of other packages are dropped.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as (pyproject.toml's package-dir)
ROOTS = {
    "src/stagetrace": "stagetrace",
    "collectors": "stagetrace.collectors",
    "exporters": "stagetrace.exporters",
    "dashboards": "stagetrace.dashboards",
}


def modules(repository: Path = REPOSITORY) -> dict[str, Path]:
    """Every module's dotted name and its file."""
    found = {}
    for folder, package in ROOTS.items():
        for path in sorted((repository / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(repository / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imported(name: str, is_package: bool, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The modules one import statement names (absolute, stagetrace's only)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        targets = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.append(sub if sub in known else base)
    else:
        return []
    out = []
    for target in targets:
        while target and target not in known:  # "import a.b.c" of a name that is not a module: its module
            target = target.rpartition(".")[0]
        if target:
            out.append(target)
    return out


def graph(repository: Path = REPOSITORY) -> dict[str, set[str]]:
    """Module -> the modules it imports (itself excluded)."""
    known = modules(repository)
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            edges[name].update(t for t in _imported(name, path.name == "__init__.py", node, known) if t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion), each
    sorted, in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                    found.append(sorted(component))
    return sorted(found)


def _in_collectors(name: str) -> bool:
    return name == "stagetrace.collectors" or name.startswith("stagetrace.collectors.")


def into_collectors(edges: dict[str, set[str]], allowed: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Arrows from modules outside ``collectors/`` into it, but from the ``allowed`` modules (those that assemble
    collectors: ``tests/test_imports.py`` names them)."""
    allowed = set(allowed)
    return sorted(
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if _in_collectors(b) and not _in_collectors(a) and a not in allowed
    )


def main() -> int:
    edges = graph()
    loops = cycles(edges)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(loops)} cycles")
    for loop in loops:
        print("cycle:", " <-> ".join(loop))
    for a, b in into_collectors(edges):
        print(f"into collectors: {a} -> {b}")
    return 1 if loops else 0


if __name__ == "__main__":
    sys.exit(main())
