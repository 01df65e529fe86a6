"""The library stays under the wire: nothing in kame/ imports server/ or client/ (docs/architecture.md),
at module level or inside a function, so `kame` works as a library without either."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
