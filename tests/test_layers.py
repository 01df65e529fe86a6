"""The project's import graph is layered. The library stays under the wire: nothing in kame/ imports
server/ or client/ (docs/architecture.md), at module level or inside a function, so `kame` works as a
library without either. And no module of kame/, server/ or client/ imports one that imports it back,
directly or through others: a lazy import inside a function counts (one that only dodges a circle is
still a circle); an import under `if TYPE_CHECKING:` does not (it never runs)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kame", "server", "client")


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_library_imports_neither_the_server_nor_the_clients():
    wire = [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for path in sorted((ROOT / "kame").rglob("*.py"))
            for line, name in _imports(path) if name.split(".")[0] in ("server", "client")]
    assert wire == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from client.conversation import converse\n    import server.cli\n")
    assert [name for _, name in _imports(probe)] == ["client.conversation", "server.cli"]


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of `packages` under `root` by dotted name; a package is its `__init__.py`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _runtime_imports(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements in `nodes`, in functions too, but not in an `if TYPE_CHECKING:` body."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test).split("."):
            yield from _runtime_imports(node.orelse)
        else:
            yield from _runtime_imports(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` loads: itself, or the longest known prefix (`kame.x.f` -> `kame.x`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules one statement of `module` imports: `from pkg import sub` is an edge to
    `pkg.sub` when that is a module, to `pkg` (its `__init__.py`) when it is a name there."""
    if isinstance(node, ast.Import):
        return {known for alias in node.names if (known := _known(alias.name, modules))}
    base = node.module or ""
    if node.level:
        package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{package}.{base}".rstrip(".")
    found = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    if len(found) < len(node.names) and (known := _known(base, modules)):
        found.add(known)
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, str]]:
    """module -> {project module it imports: "path:line" of the first statement that does}."""
    modules = _modules(root, packages)
    graph: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in _runtime_imports([ast.parse(path.read_text())]):
            for target in sorted(_targets(node, module, modules) - {module}):
                edges.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return graph


def import_circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert {"kame.session", "server.app", "server.doctor.models", "client.cli"} <= set(graph)
    report = [" <-> ".join(circle) + "".join(f"\n    {where}: {module} imports {target}"
                                              for module in circle for target, where in graph[module].items()
                                              if target in circle)
              for circle in import_circles(graph)]
    assert report == [], "import circles:\n" + "\n".join(report)


def test_the_graph_resolves_what_python_would_load(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.low import VALUE\n",
        "pkg/low.py": "VALUE = 1\n",
        "pkg/sub/__init__.py": "from .. import low\nfrom . import leaf\n",
        "pkg/sub/leaf.py": ("from typing import TYPE_CHECKING\nimport os\nfrom pkg import VALUE\n"
                            "if TYPE_CHECKING:\n    from pkg.top import Top\nelse:\n    from ..low import VALUE\n"
                            "def f():\n    import pkg.sub.deep.name_in_it\n    from .deep import thing\n"),
        "pkg/sub/deep.py": "",
        "pkg/top.py": "def g():\n    from pkg.sub import leaf, name_in_init\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {
        "pkg": {"pkg.low": "pkg/__init__.py:1"},
        "pkg.low": {},
        "pkg.sub": {"pkg.low": "pkg/sub/__init__.py:1", "pkg.sub.leaf": "pkg/sub/__init__.py:2"},
        "pkg.sub.leaf": {"pkg": "pkg/sub/leaf.py:3", "pkg.low": "pkg/sub/leaf.py:7",
                         "pkg.sub.deep": "pkg/sub/leaf.py:9"},
        "pkg.sub.deep": {},
        "pkg.top": {"pkg.sub": "pkg/top.py:2", "pkg.sub.leaf": "pkg/top.py:2"},
    }
    assert import_circles(graph) == []
    (tmp_path / "pkg/low.py").write_text("def h():\n    from pkg.sub.leaf import f\n")
    assert import_circles(import_graph(tmp_path, ("pkg",))) == [["pkg", "pkg.low", "pkg.sub.leaf"]]
