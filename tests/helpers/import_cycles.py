"""Import cycles among the modules of a package, found from the source with ``ast`` (nothing is
imported). Run ``python -m tests.helpers.import_cycles [package_dir]`` (default ``srt``): it prints
every cycle and exits 1 when there is one.

Every import statement counts, wherever it is: module level, inside a function (a lazy import is
still a dependency) and under ``if TYPE_CHECKING:`` (a type-only import still ties the two
modules' interfaces together). ``import a.b.c`` / ``from a.b import c`` is an edge to the deepest
module that exists (``a.b.c`` when it is a module, else ``a.b``), plus an edge to every package
on the way (``a``, ``a.b``): importing a submodule runs its packages' ``__init__`` first. Edges to
the importer's own packages are left out: they are initialized before the importer runs.

A cycle is reported as one strongly connected component (sorted module names) and one closed
path through it, e.g. ``srt.a -> srt.b -> srt.a``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ImportCycle:
    modules: tuple[str, ...]  # the strongly connected component, sorted
    path: tuple[str, ...]  # one closed walk through it: path[0] == path[-1]

    def __str__(self) -> str:
        return " -> ".join(self.path)


def _module_names(root: Path) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under the package directory ``root``."""
    base = root.parent
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names this module's import statements name (candidates: may be attributes)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def import_graph(package_dir: str | Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for what counts)."""
    root = Path(package_dir).resolve()
    modules = _module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        edges: set[str] = set()
        for dotted in _imported_names(tree, name, path.name == "__init__.py"):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                target = ".".join(parts[:i])
                if target in modules:
                    edges.add(target)
                    break
            edges.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        graph[name] = edges - own_packages
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _closed_path(graph: dict[str, set[str]], component: list[str]) -> tuple[str, ...]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]  # walk back to start, then read it forwards
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return (*reversed(path), start)
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its own component")


def find_cycles(package_dir: str | Path = "srt") -> list[ImportCycle]:
    """Every import cycle among the modules under ``package_dir`` (empty when there is none)."""
    graph = import_graph(package_dir)
    return [ImportCycle(tuple(c), _closed_path(graph, c)) for c in _strongly_connected(graph)]


def main(argv: list[str]) -> int:
    package_dir = argv[0] if argv else "srt"
    cycles = find_cycles(package_dir)
    for cycle in cycles:
        print(f"import cycle: {cycle}\n    component: {', '.join(cycle.modules)}")
    if not cycles:
        print(f"no import cycle among the modules of {package_dir}")
    return 1 if cycles else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
