"""The size rules of docs/development.md, checked: modules under 500 lines (benchmarks/ included), public
constructors with at most 5 arguments, no reference to documents outside the repository, and benchmarks
that use the project only through its public surface."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("recsys", "embedding_store", "pipelines")
MAX_LINES = 500
MAX_ARGS = 5


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _public_constructors(path: Path) -> list[tuple[str, int]]:
    """``(class name, argument count without self)`` of every public class's ``__init__`` in ``path``
    (dataclasses excluded: their fields are keyword-only records, not a constructor's argument list)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                a = item.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1  # self
                out.append((node.name, count))
    return out


def test_the_checks_see_the_code():
    """The walk finds the modules and constructors it is meant to check (a check over nothing passes)."""
    modules = _modules()
    assert len(modules) > 50
    names = {name for path in modules for name, _ in _public_constructors(path)}
    assert {"TieredStore", "StagedPipeline", "Trainer", "TrainLoop"} <= names


def _benchmark_modules() -> list[Path]:
    return sorted((ROOT / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("path", _modules() + _benchmark_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_under_500_lines(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it by job"


def test_public_constructors_take_at_most_5_arguments():
    wide = [
        f"{path.relative_to(ROOT)}: {name} takes {count}"
        for path in _modules()
        for name, count in _public_constructors(path)
        if count > MAX_ARGS
    ]
    assert not wide, "constructors with more than 5 arguments (group them in a value object): " + "; ".join(
        wide
    )


def test_no_reference_to_documents_outside_the_repository():
    pattern = re.compile(r"\b(DESIGN|FACTS)\b")
    roots = [*PACKAGES, "tests", "benchmarks"]
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for root in roots
        for p in sorted((ROOT / root).rglob("*.py"))
        if p.name != Path(__file__).name
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"references to documents that are not in the repository: {found}"


_PROJECT = ("recsys", "embedding_store", "pipelines")
# The SSD tier's backend modules: benchmarks open a backend through embedding_store.backends.open_backend.
_BACKEND_MODULES = re.compile(r"^embedding_store\.(lmdb_backend|lmdb_log|lmdb_scan|backends\.\w+)$")


def _benchmark_violations(path: Path) -> list[str]:
    """What in ``path`` reaches past the project's public surface: a private attribute of anything but
    ``self``/``cls``, ``setattr``, an attribute of a project module or class assigned, a function or
    lambda assigned over another object's attribute (a monkeypatch), an import of a backend module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    project_names: set[str] = set()
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(path.parents[1])}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module:
            if _BACKEND_MODULES.match(node.module):
                out.append(f"{where}: imports {node.module}")
            if node.module.split(".")[0] in _PROJECT:
                project_names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _BACKEND_MODULES.match(alias.name):
                    out.append(f"{where}: imports {alias.name}")
                if alias.name.split(".")[0] in _PROJECT:
                    project_names.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        where = f"{path.relative_to(path.parents[1])}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{where}: reads {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            out.append(f"{where}: setattr")
        elif isinstance(node, ast.Assign):
            replaced = isinstance(node.value, ast.Lambda) or (
                isinstance(node.value, ast.Name) and node.value.id in functions
            )
            for target in node.targets:
                for attr in (t for t in ast.walk(target) if isinstance(t, ast.Attribute)):
                    root = attr.value
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if not isinstance(root, ast.Name) or root.id in ("self", "cls"):
                        continue
                    if root.id in project_names or replaced:
                        out.append(f"{where}: assigns {ast.unparse(attr)}")
    return out


def test_the_benchmark_check_sees_a_monkeypatch(tmp_path):
    """The check below finds each kind of reach it forbids (a check that finds nothing proves nothing)."""
    sample = tmp_path / "benchmarks" / "probe.py"
    sample.parent.mkdir()
    text = (
        "from embedding_store import TieredStore\n"
        "from embedding_store.backends.log import LogBackend\n"
        "def fake(*a):\n    return None\n"
        "def run(store, backend):\n"
        "    TieredStore.prefetch = fake\n"
        "    backend.get_rows = fake\n"
        "    store.evict = lambda *a: 0\n"
        "    setattr(store, 'x', 1)\n"
        "    return store._backend\n"
    )
    sample.write_text(text, encoding="utf-8")
    found = _benchmark_violations(sample)
    kinds = [
        "imports",
        "TieredStore.prefetch",
        "backend.get_rows",
        "store.evict",
        "setattr",
        "store._backend",
    ]
    assert all(any(k in f for f in found) for k in kinds), found


def test_benchmarks_use_the_public_surface():
    """Benchmarks measure the project as users run it: no private fields, no patched methods (a wrapper
    handed to ``TieredStore(..., backend=)`` counts or times the backend), no backend modules."""
    found = [v for path in _benchmark_modules() for v in _benchmark_violations(path)]
    assert not found, "benchmarks reaching past the public surface: " + "; ".join(found)
