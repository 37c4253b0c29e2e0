"""The map cannot drift from the territory: every repository path, every ``path::Name.attr`` and every dotted
``package.module.Name`` that README.md and docs/ARCHITECTURE.md name must exist (issue 36).

- a path (``engine/sched/scheduler.py``, ``server/inspector/``, ``docs/SERVER.md#anchor``, ``.ci/run``): the file or folder
  exists;
- ``engine/sched/scheduler.py::Scheduler.schedule``: the file defines ``Scheduler`` (a class, function or assignment at
  its top level) and the class defines ``schedule`` (a method, property, field or nested class);
- an inline-code ``engine.core.api.EngineCoreClient``: the longest prefix that is a module exists, and the rest is
  defined in it the same way;
- a relative markdown link: its target exists (in every page of docs/ too).

Nothing is imported: definitions are read with ``ast``, so the check runs without torch and sees what a reader sees.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/ARCHITECTURE.md")
PACKAGES = ("engine", "server", "kernels", "benchmarks")

PATH = re.compile(r"(?<![\w/.~-])((?:engine|server|kernels|benchmarks|tests|docs|\.ci)/[\w./-]*[\w/])")
QUALIFIED = re.compile(r"(?<![\w/.-])((?:engine|server|kernels|benchmarks|tests)/[\w/]+\.py)::([A-Za-z_][\w.]*)")
DOTTED = re.compile(r"^((?:engine|server|kernels|benchmarks)(?:\.[A-Za-z_]\w*)+)$")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def references(text: str) -> tuple[set[str], set[tuple[str, str]], set[str], set[str]]:
    """(paths, (file, qualified name) pairs, dotted names, relative link targets) named in a markdown text."""
    paths = {m.group(1) for m in PATH.finditer(text)}
    qualified = {(m.group(1), m.group(2).rstrip(".")) for m in QUALIFIED.finditer(text)}
    prose = FENCE.sub("", text)
    dotted = {m.group(1) for span in INLINE.findall(prose) if (m := DOTTED.match(span.strip().rstrip("()")))}
    links = {target for target in LINK.findall(prose) if not re.match(r"^(?:[a-z]+:|#)", target)}
    return paths, qualified, dotted, links


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _defined(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The statement of ``body`` that defines ``name`` (def, class, assignment, annotated field), or None."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, (ast.If, ast.Try)):  # a definition under a top-level condition
            found = _defined(node.body + getattr(node, "orelse", []), name)
            if found is not None:
                return found
    return None


def defines(path: Path, qualified: str) -> bool:
    """Whether the module at ``path`` defines ``A`` (or ``A.b``, a member of class ``A``, and so on)."""
    body: list[ast.stmt] = _tree(path).body
    for part in qualified.split("."):
        node = _defined(body, part)
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _module_file(dotted: str) -> Path | None:
    base = ROOT / dotted.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolve_dotted(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:cut]))
        if module is not None:
            rest = ".".join(parts[cut:])
            return not rest or defines(module, rest)
    return False


def _doc(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_named_exists(doc: str):
    paths, qualified, _, _ = references(_doc(doc))
    missing = sorted(p for p in paths | {f for f, _ in qualified} if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_function_named_is_defined_where_it_says(doc: str):
    _, qualified, dotted, _ = references(_doc(doc))
    wrong = sorted(f"{f}::{name}" for f, name in qualified if (ROOT / f).is_file() and not defines(ROOT / f, name))
    wrong += sorted(d for d in dotted if not resolve_dotted(d))
    assert not wrong, f"{doc} names functions, classes or modules that are not defined there: {wrong}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc: str):
    _, _, _, links = references(_doc(doc))
    base = (ROOT / doc).parent
    missing = sorted(t for t in links if not (base / t.split("#")[0]).exists())
    assert not missing, f"{doc} links to files that do not exist: {missing}"


def test_every_relative_link_of_the_docs_resolves():
    """The pages the README's material moved to (docs/, docs/bench/) link to each other; none of the links dangles."""
    missing = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        _, _, _, links = references(page.read_text(encoding="utf-8"))
        missing += [f"{page.relative_to(ROOT)} -> {target}" for target in sorted(links)
                    if not (page.parent / target.split("#")[0]).exists()]
    assert not missing, f"links to files that do not exist: {missing}"


def test_the_architecture_walk_names_real_code():
    """The checks above are not vacuous: the architecture document names many paths and functions, the request's
    life among them."""
    paths, qualified, dotted, links = references(_doc("docs/ARCHITECTURE.md"))
    assert len(paths) > 150 and len(qualified) > 40 and len(links) >= 5, (len(paths), len(qualified), len(links))
    for step in ("server/http/app.py::generate", "engine/sched/scheduler.py::Scheduler.schedule",
                 "engine/kv/manager.py::KVCacheManager.admit", "engine/worker/model_runner.py::ModelRunner.execute"):
        file, name = step.split("::")
        assert (file, name) in qualified, step


def test_the_checker_catches_drift():
    text = ("`engine/request.py` `engine/sched/scheduler.py::Scheduler.no_such_method` `engine.sched.scheduler.NoSuchClass` "
            "[x](docs/NOPE.md) `engine/sched/scheduler.py::Scheduler.schedule` `engine.core.api.EngineFacts.of`")
    paths, qualified, dotted, links = references(text)
    assert not (ROOT / "engine/request.py").exists() and "engine/request.py" in paths
    assert not defines(ROOT / "engine/sched/scheduler.py", "Scheduler.no_such_method")
    assert defines(ROOT / "engine/sched/scheduler.py", "Scheduler.schedule")
    assert not resolve_dotted("engine.sched.scheduler.NoSuchClass") and resolve_dotted("engine.core.api.EngineFacts.of")
    assert dotted == {"engine.sched.scheduler.NoSuchClass", "engine.core.api.EngineFacts.of"} and links == {"docs/NOPE.md"}


def test_every_module_is_on_the_map():
    """The other way round: every module of the product (``__init__`` and ``__main__`` aside) is named in
    docs/ARCHITECTURE.md, so a newcomer finds any file from it."""
    paths, qualified, _, _ = references(_doc("docs/ARCHITECTURE.md"))
    named = paths | {f for f, _ in qualified}
    modules = sorted(p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    missing = [m for m in modules if m not in named]
    assert not missing, f"docs/ARCHITECTURE.md's module index lacks: {missing}"
