"""The size rules of docs/development.md, checked: modules under 500 lines, public constructors with at
most 5 arguments, and no reference to documents outside the repository."""

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


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
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
