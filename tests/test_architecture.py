"""The package's shape: no import of `bench` from the library, no import cycles between its modules
(imports inside functions included), and the decode step's arguments few and fixed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jtilert"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(path: Path, mods=None) -> set[str]:
    """The modules a file imports, at any depth of the file: `from jtilert.ops import reference` is
    jtilert.ops.reference, `from jtilert.ops.table import Ops` is jtilert.ops.table."""
    mods = mods or {}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(f, mods) if i in mods and i != m} for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    seen, stack, found = set(), [], []

    def visit(m):
        if m in stack:
            found.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    return found


def test_library_imports_nothing_from_bench():
    code = ("import sys, jtilert, jtilert.pallas, jtilert.ffi\n"
            "import jtilert.pallas.gemv, jtilert.pallas.moe, jtilert.pallas.indexer, jtilert.pallas.sparse_mla\n"
            "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    for f in PACKAGE.rglob("*.py"):
        assert not any(i == "bench" or i.startswith("bench.") for i in _imports(f)), f


def test_no_import_cycles_between_library_modules():
    graph = _graph()
    assert "jtilert.model.transformer" in graph and "jtilert.ops.table" in graph["jtilert.model.transformer"]   # the walk sees imports
    assert _cycles(graph) == []
