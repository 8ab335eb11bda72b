"""The project's modules import one another without a circle: every import, at module level or
inside a function, is an edge of the graph walked here."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("strategies", "tasks", "cpu_backend")


def project_modules() -> dict[str, Path]:
    """Module name -> file: the top-level files, the packages' modules, and the scripts (run with
    scripts/ on the path)."""
    modules = {p.stem: p for p in ROOT.glob("*.py")}
    modules.update({p.stem: p for p in (ROOT / "scripts").glob("*.py")})
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports: `from a.b import c` counts as a.b.c where that is a
    module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            if name in modules:
                found.add(name)
                break
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert graph["cache"] and "model" not in graph["cache"]  # the caches take attention math from attention.py
    assert cycle(graph) is None, " -> ".join(cycle(graph))
