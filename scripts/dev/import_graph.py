"""The import graph of the shipped package: rooms, arrows, circles and arrows that point up.

Run ``python scripts/dev/import_graph.py [-v] [package_dir]`` (``-v``: every arrow too;
default: ``contextpilot_integrations`` next to this repository's root). It parses every
module with :mod:`ast` (nothing is imported, so optional dependencies need not be installed)
and counts every import of the package's own modules: at module level, inside functions and
under ``TYPE_CHECKING`` alike (a type-only import still ties the two modules together).

- A room is a module (``pilot/facade.py`` is ``pilot.facade``; a package is its ``__init__``).
  ``from .x import y`` points at ``x.y`` when that is a module, else at ``x``.
- Circles: strongly connected components of the module graph (networkx when installed, else
  Tarjan's algorithm below), and the same for folders (each top-level folder or root module
  one node), where ``pilot.py`` <-> ``shared/`` showed before the pilot was composed.
- Layers, lowest first (:data:`LAYERS`): the core model (the root modules the pilot builds
  on, or ``core/``), the index, the hosted providers' data (cache keys, plans, usage), the
  shared log (it owns the narrow interface it needs of an index and never imports the pilot:
  the pilot hands itself to it), the pilot, what uses the pilot (engines; the adapters' glue
  at the root: batching, binding, implicit, hosted_*; the package ``__init__``, the public
  face), and the simulator with its command line and test fakes (``testing/``). An arrow
  points up when a module imports one of a higher layer. A module no layer names counts as
  core, so a new folder that imports upwards shows here until it is given its layer.

``--sizes``: also the largest modules and classes (lines) and the public members of each
package's face (``__all__`` of every ``__init__``), the other half of measuring the house.

Exit status 1 when there is a circle or an arrow up (usable as a check).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "contextpilot_integrations"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core", "errors", "blocks", "usage", "validation", "annotations", "prepared", "gain", "conversations")),
    ("index", ("index",)),
    ("providers", ("providers",)),
    ("shared", ("shared",)),
    ("pilot", ("pilot",)),
    ("engines", ("engines",)),
    ("integration", ("integration", "")),
    ("whatif", ("whatif", "testing", "__main__")),
]
"""Layer name and the rooms in it: a module belongs to the layer of its longest listed prefix
(a room or a folder: ``engines`` holds ``engines.router``); ``""`` is the package itself."""

UP_ALLOWED: set[tuple[str, str]] = set()
"""Arrows up accepted on purpose (none)."""


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _arrows(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if name else []
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here if is_package else here[:-1]
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    parts = base + (node.module.split(".") if node.module else [])
                elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                    parts = node.module.split(".")[1:]
                else:
                    continue
                module = ".".join(parts)
                for alias in node.names:
                    sub = f"{module}.{alias.name}" if module else alias.name
                    targets.append(sub if sub in modules else module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        targets.append(".".join(alias.name.split(".")[1:]))
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def layer_of(module: str) -> int:
    best, best_len = 0, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one room (circles)."""
    try:
        import networkx as nx
    except ImportError:
        return _tarjan(graph)
    g = nx.DiGraph([(a, b) for a, outs in graph.items() for b in outs])
    g.add_nodes_from(graph)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def _tarjan(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    def folder(m: str) -> str:
        return m.split(".")[0] if m else "__init__"

    out: dict[str, set[str]] = defaultdict(set)
    for a, outs in graph.items():
        out[folder(a)]
        for b in outs:
            if folder(a) != folder(b):
                out[folder(a)].add(folder(b))
    return dict(out)


def _sizes(modules: dict[str, Path], top: int = 8) -> None:
    """The largest modules and classes, and how many names each package's face exports."""
    lines: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    faces: list[tuple[int, str]] = []
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, str(path))
        lines.append((len(source.splitlines()), name or PACKAGE))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
            if path.name == "__init__.py" and isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                    if isinstance(node.value, (ast.List, ast.Tuple)):
                        faces.append((len(node.value.elts), name or PACKAGE))
    for title, rows in (("largest modules (lines)", lines), ("largest classes (lines)", classes)):
        print(f"{title}:")
        for size, what in sorted(rows, reverse=True)[:top]:
            print(f"  {size:5d}  {what}")
    print(f"public members (__all__ of each package): {sum(n for n, _ in faces)}")
    for size, what in sorted(faces, reverse=True):
        print(f"  {size:5d}  {what}")


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    sizes = "--sizes" in argv
    argv = [a for a in argv if a not in ("-v", "--sizes")]
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / PACKAGE
    modules = _modules(root)
    graph = _arrows(modules)
    arrows = sorted((a, b) for a, outs in graph.items() for b in outs)
    up = [(a, b) for a, b in arrows if layer_of(b) > layer_of(a) and (a, b) not in UP_ALLOWED]
    circles = _components(graph)
    folder_circles = _components(_folders(graph))
    print(f"rooms (modules): {len(modules)}")
    print(f"arrows: {len(arrows)}")
    print(f"circles (modules): {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    print(f"circles (folders): {len(folder_circles)}")
    for circle in folder_circles:
        print("  " + " <-> ".join(circle))
    print(f"arrows up: {len(up)}")
    for a, b in up:
        print(f"  {a or PACKAGE} ({LAYERS[layer_of(a)][0]}) -> {b or PACKAGE} ({LAYERS[layer_of(b)][0]})")
    if sizes:
        _sizes(modules)
    if verbose:
        for a, b in arrows:
            print(f"{a or PACKAGE} -> {b or PACKAGE}")
    return 1 if circles or up else 0  # a folder circle is shown, not failed: a folder may hold two layers


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
