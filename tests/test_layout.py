"""The import graph: packages only import downwards, and no two modules import each other.

Every import is parsed from source, lazy ones included (inside functions, under
``TYPE_CHECKING``), and so are string references to our modules handed to
``importlib.import_module`` (the CLI's dispatch table). Two kinds of reference are not
imports and are left out: ``python -m MODULE`` argument lists (a process launch) and the
body of ``if __name__ == "__main__":`` (the module runs as a script there).

The package order it pins, beneath the one import name ``stripefs``::

    wire < rpc < {metadata, storage, fsclient} < {staging, kvcache} < bench < stripefs (the CLI)

Each layer keeps its folder at the top of the repository and installs as
``stripefs.LAYER`` (pyproject's ``package-dir``); the wheel's only top-level name is
``stripefs``, and no module of ours imports a layer by its bare folder name.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANK = {"wire": 0, "rpc": 1, "metadata": 2, "storage": 2, "fsclient": 2, "staging": 3, "kvcache": 3, "bench": 4, "stripefs": 5}
LAYERS = [pkg for pkg in RANK if pkg != "stripefs"]  # folders that install as stripefs.<folder>


def _modules() -> dict[str, Path]:
    """Every module of ours by its installed dotted name (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for pkg in RANK:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if pkg != "stripefs":
                parts.insert(0, "stripefs")
            found[".".join(parts)] = path
    return found


def layer(mod: str) -> str:
    """The package of the order a module belongs to: ``stripefs.wire._frames`` -> ``wire``;
    the modules of the ``stripefs`` folder itself (the CLI, the demo) are the top."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "stripefs"


MODULES = _modules()


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _launch_args(tree: ast.AST) -> set[int]:
    """ids of string nodes that are not imports: those that follow ``"-m"`` in a list or tuple
    (process launches) and logger names (``logging.getLogger("stripefs.staging")``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                and node.args and isinstance(node.args[0], ast.Constant)):
            skip.add(id(node.args[0]))
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
    assert "stripefs.staging.mover_cli" in GRAPH["stripefs.cli"]  # the CLI's dispatch table
    assert "stripefs.fsclient.fuse._operations" in GRAPH["stripefs.fsclient.fuse._daemon"]  # inside a function
    # `python -m stripefs.metadata` is a launch, not an import
    assert "stripefs.metadata" not in GRAPH["stripefs.fsclient.testing._cluster"]


@pytest.mark.parametrize("pkg", sorted(RANK))
def test_packages_only_import_downwards(pkg: str) -> None:
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in GRAPH.items() if layer(mod) == pkg
        for dep in deps if layer(dep) != pkg and RANK[layer(dep)] >= RANK[pkg]
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
            a, b = layer(mod), layer(dep)
            if a != b:
                edges[a].add(b)
    # Every package depends on at least the one below it that it is built on.
    assert edges["rpc"] == {"wire"}
    assert edges["staging"] <= {"wire", "rpc", "fsclient"}
    assert "stripefs" not in set().union(*edges.values())


def _bare_imports(path: Path) -> list[str]:
    """Imports that name one of our layers by its folder (``import wire``, ``from fsclient
    import Client``, ``python -m metadata``, ``set_forkserver_preload(["fsclient"])``): they
    work from a checkout and fail where stripefs is installed."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in _BY_NAME:
            names = [a.value for arg in node.args for a in ast.walk(arg)
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, (ast.List, ast.Tuple)):  # ``python -m MODULE`` launches
            elts = node.elts
            names = [b.value for a, b in zip(elts, elts[1:]) if isinstance(a, ast.Constant) and a.value == "-m"
                     and isinstance(b, ast.Constant) and isinstance(b.value, str)]
        bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in LAYERS]
    return bad


# Calls whose string arguments name modules to import (the CLI's table goes through the
# first; benchmarks check optional routes with the last).
_BY_NAME = {"import_module", "set_forkserver_preload", "need_module"}


def test_every_import_of_a_layer_goes_through_stripefs() -> None:
    files = [p for pkg in [*RANK, "tests"] for p in (ROOT / pkg).rglob("*.py")]
    bad = [hit for path in files for hit in _bare_imports(path)]
    assert not bad, "import stripefs.LAYER, not LAYER:\n" + "\n".join(bad)


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    # Build the real wheel, from a copy (setuptools reuses build/: a module deleted since
    # the last build would ride along), and read it: every module of ours is in it, under stripefs/.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("stripefs-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"stripefs"}
    shipped = {n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    assert shipped == set(MODULES), sorted(shipped ^ set(MODULES))
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "stripefs = stripefs.fsclient.fsspec:StripeFileSystem" in entry_points
    assert "stripefs = stripefs.cli:main" in entry_points
