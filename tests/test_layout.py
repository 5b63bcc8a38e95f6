"""The import graph: packages only import downwards, and no two modules import each other.

Every import is parsed from source, lazy ones included (inside functions, under
``TYPE_CHECKING``), and so are string references to our modules handed to
``importlib.import_module`` (the CLI's dispatch table). Two kinds of reference are not
imports and are left out: ``python -m MODULE`` argument lists (a process launch) and the
body of ``if __name__ == "__main__":`` (the module runs as a script there).

The package order it pins::

    wire < rpc < {metadata, storage, fsclient} < staging < bench < stripefs (the CLI)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANK = {"wire": 0, "rpc": 1, "metadata": 2, "storage": 2, "fsclient": 2, "staging": 3, "bench": 4, "stripefs": 5}


def _modules() -> dict[str, Path]:
    """Every module of ours by dotted name (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for pkg in RANK:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _launch_args(tree: ast.AST) -> set[int]:
    """ids of string nodes that follow ``"-m"`` in a list or tuple: process launches."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            elts = node.elts
            for a, b in zip(elts, elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant):
                    skip.add(id(b))
    return skip


def _resolve(module: str, name: str | None) -> str | None:
    """The module of ours that ``from module import name`` (or ``import module``) loads."""
    if name and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module if module in MODULES else None


def imports_of(mod: str) -> set[str]:
    path = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):  # drop `if __name__ == "__main__":` bodies
        if isinstance(node, ast.Module):
            node.body = [n for n in node.body if not _is_main_guard(n)]
    skip = _launch_args(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [_resolve(module, a.name) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            targets = [node.value] if node.value in MODULES and "." in node.value else []
        out.update(t for t in targets if t and t != mod)
    return out


GRAPH = {mod: imports_of(mod) for mod in MODULES}


def test_the_graph_sees_lazy_and_string_imports() -> None:
    # Guards the parser itself: these edges exist and are lazy or by name.
    assert "staging.mover_cli" in GRAPH["stripefs.cli"]  # the CLI's dispatch table
    assert "fsclient.fuse._operations" in GRAPH["fsclient.fuse._daemon"]  # inside a function
    assert "metadata" not in GRAPH["fsclient.testing._cluster"]  # `python -m metadata` is a launch


@pytest.mark.parametrize("pkg", sorted(RANK))
def test_packages_only_import_downwards(pkg: str) -> None:
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in GRAPH.items() if mod.split(".")[0] == pkg
        for dep in deps if dep.split(".")[0] != pkg and RANK[dep.split(".")[0]] >= RANK[pkg]
    )
    assert not bad, "imports against the package order:\n" + "\n".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules() -> None:
    assert _cycles() == []


def test_each_way_in_is_a_subpackage() -> None:
    for sub in ("core", "fuse", "fsspec", "batchread", "testing"):
        assert (ROOT / "fsclient" / sub / "__init__.py").is_file(), sub
    flat = sorted(p.name for p in (ROOT / "fsclient").glob("*.py"))
    assert flat == ["__init__.py"], flat


def test_package_edges_are_what_the_docs_show() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, deps in GRAPH.items():
        for dep in deps:
            a, b = mod.split(".")[0], dep.split(".")[0]
            if a != b:
                edges[a].add(b)
    # Every package depends on at least the one below it that it is built on.
    assert edges["rpc"] == {"wire"}
    assert edges["staging"] <= {"wire", "rpc", "fsclient"}
    assert "stripefs" not in set().union(*edges.values())
