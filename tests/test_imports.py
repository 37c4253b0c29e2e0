"""No import circles between kvserve's modules (issue 36).

The import graph of every module of the packages engine, kernels, server and benchmarks is built from the source
(``ast``, no import executed), relative imports resolved. Each import statement is one of three kinds:

- *top-level*: runs when the module is imported (module body, class bodies, top-level ``try`` / ``if``);
- *function-level*: inside a function, runs when the function is called (a deliberate late import);
- *type-checking*: under ``if TYPE_CHECKING:``, never runs.

A cycle among top-level imports is a real circle: which module finishes loading first depends on who is imported
first, and a name used at import time may not exist yet. Such cycles fail the test. Function-level imports are
counted (so a later change that turns many of them into top-level ones shows up) but are allowed to close a loop:
they are how a layer reaches back without a circle at import time.

``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg`` (its ``__init__``).
Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit edges are left out (as import-linter
and pydeps leave them out): a package's ``__init__`` that re-exports its submodules (server/parsing,
server/rendering) would otherwise put every module inside it in a loop with it.

Loops closed only by function-level imports are listed in `KNOWN_LATE_CYCLES`, each with why it is there: a new
one fails too, so a late import that closes a circle is a decision someone wrote down, not an accident.
"""
from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "server", "benchmarks")

# Cycles among top-level imports that are known and not yet cut, each as the sorted tuple of its modules, with the
# issue that tracks it. Empty: there are none. Add one only with a comment naming its issue.
KNOWN_CYCLES: set[tuple[str, ...]] = set()

# Loops that exist only through a function-level (late) import, each with why. Empty: issue 36 cut the last ones
# (the core's contract moved to the leaf engine/core/api.py, generation.py reaches the inspector by a callback, the
# workload catalog and the hybrid report sit above what they build on, the registry hands a tiny Gemma model the
# directory its tokenizer is copied from). Add one only saying why.
KNOWN_LATE_CYCLES: dict[tuple[str, ...], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def all_modules() -> dict[str, Path]:
    """Every module of the four packages, by dotted name."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(node, kind) for every import statement, kind one of 'top', 'function', 'type_checking'."""
    def walk(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and kind == "top":
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "top")
            else:
                yield from walk(child, kind)
    yield from walk(tree, "top")


def _resolve(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The kvserve modules an import statement loads (outside modules dropped)."""
    targets: set[str] = set()

    def add(name: str) -> None:
        # The longest prefix of `name` that is one of our modules (``import engine.kv.state_pool as s`` -> itself).
        parts = name.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                targets.add(candidate)
                return
            parts.pop()

    if isinstance(node, ast.Import):
        for alias in node.names:
            add(alias.name)
        return targets
    if node.level:
        package_parts = module.split(".") if is_package else module.split(".")[:-1]
        base_parts = package_parts[: len(package_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            targets.add(f"{base}.{alias.name}")
        else:
            add(base)
    return targets


@functools.cache
def import_graph() -> tuple[dict[str, dict[str, set[str]]], Counter]:
    """{kind: {module: {imported module, ...}}} and the number of import statements per kind."""
    modules = all_modules()
    graph: dict[str, dict[str, set[str]]] = {k: {m: set() for m in modules} for k in ("top", "function",
                                                                                        "type_checking")}
    counts: Counter = Counter()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, kind in _imports(tree):
            targets = _resolve(node, module, path.name == "__init__.py", modules)
            targets.discard(module)
            if targets:
                counts[kind] += 1
                graph[kind][module] |= targets
    return graph, counts


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative, so deep graphs never hit the recursion limit
        nonlocal counter
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                        found.append(tuple(sorted(component)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _describe(component: tuple[str, ...], edges: dict[str, set[str]]) -> str:
    members = set(component)
    inner = [f"{a} -> {b}" for a in component for b in sorted(edges[a]) if b in members]
    return f"{len(component)} modules: " + "; ".join(inner)


def test_the_graph_sees_the_imports_it_should():
    """The parser itself: relative imports resolve, and the three kinds are told apart on known modules."""
    graph, counts = import_graph()
    assert len(graph["top"]) > 150, "every module of the four packages is in the graph"
    assert counts["top"] > 300 and counts["function"] > 50, counts
    assert "engine.sampling_params" in graph["top"]["engine.llm"]
    # engine/__init__.py loads its names lazily: only under TYPE_CHECKING, never at import time.
    assert not graph["top"]["engine"] and "engine.llm" in graph["type_checking"]["engine"]
    # A relative import inside a subpackage resolves against that subpackage.
    relative = [m for m, path in all_modules().items()
                if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(path.read_text())))]
    for module in relative:
        assert graph["top"][module] | graph["function"][module] | graph["type_checking"][module], module


def test_no_import_circle_among_top_level_imports():
    graph, counts = import_graph()
    found = set(cycles(graph["top"]))
    new = sorted(found - KNOWN_CYCLES)
    assert not new, "import circles among top-level imports (cut one edge: a leaf module for the shared types, " \
        "a late import, or a callback):\n" + "\n".join(_describe(c, graph["top"]) for c in new)
    gone = KNOWN_CYCLES - found
    assert not gone, f"known cycles that no longer exist, drop them from KNOWN_CYCLES: {sorted(gone)}"


def test_circles_through_late_imports_are_the_known_ones():
    """A function-level import that closes a loop is allowed only where `KNOWN_LATE_CYCLES` says why."""
    graph, counts = import_graph()
    runtime = {m: graph["top"][m] | graph["function"][m] for m in graph["top"]}
    found = set(cycles(runtime))
    new = sorted(found - set(KNOWN_LATE_CYCLES) - KNOWN_CYCLES)
    assert not new, "new import circles closed by function-level imports (cut them, or add them to " \
        "KNOWN_LATE_CYCLES saying why):\n" + "\n".join(_describe(c, runtime) for c in new)
    gone = set(KNOWN_LATE_CYCLES) - found
    assert not gone, f"known late-import circles that no longer exist, drop them from KNOWN_LATE_CYCLES: {sorted(gone)}"


def test_the_core_never_imports_its_client():
    """The engine core (both cores and their wire) import the contract (engine/core/api.py), never
    engine/core/client.py, whose `start_core` builds them; and the pipeline does not import the inspector."""
    graph, _ = import_graph()
    for core in ("engine.core.loop", "engine.core.process", "engine.core.wire", "engine.core.api"):
        reach = graph["top"][core] | graph["function"][core] | graph["type_checking"][core]
        assert "engine.core.client" not in reach, core
    generation = graph["top"]["server.pipeline.generation"] | graph["function"]["server.pipeline.generation"]
    assert not any(m.startswith("server.inspector") for m in generation), sorted(generation)


def test_the_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set(), "f": {"f"}}
    assert cycles(edges) == [("a", "b", "c")]
