"""docs/datasets.md documents every spec key: each section's table lists exactly the dataclass's fields.

The reference is the "Every key of a spec" part of the doc: a ``#### `[section]` `` heading per section,
then a table whose rows start with ``| `key` | default | meaning |``. A default written as a TOML value
in backticks must be the dataclass's default.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import tomllib
from pathlib import Path

import pytest

from recsys.data.spec import (
    DatasetSpec,
    DenseSpec,
    JoinSpec,
    LabelSpec,
    ReadSpec,
    SourceSpec,
    SparseSpec,
    SplitSpec,
)
from recsys.data.synthetic import SyntheticConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "datasets.md"

# The spec's tables are sections of their own; `path` is where the spec was read from, not a key.
_NOT_TOP_LEVEL_KEYS = {"path", "source", "read", "join", "label", "split", "dense", "sparse", "synthetic"}

SECTIONS = {
    "Top level": DatasetSpec,
    "[source]": SourceSpec,
    "[read]": ReadSpec,
    "[[join]]": JoinSpec,
    "[label]": LabelSpec,
    "[split]": SplitSpec,
    "[[dense]]": DenseSpec,
    "[[sparse]]": SparseSpec,
    "[synthetic]": SyntheticConfig,
}

_ROW = re.compile(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|([^|]*)\|")


def documented(text: str) -> dict[str, dict[str, str]]:
    """{section heading: {key: default cell}} of every ``####`` section, code blocks left out."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            current = sections.setdefault(line[level:].strip().strip("`"), {}) if level == 4 else None
            continue
        if current is not None and (row := _ROW.match(line)):
            current[row.group(1)] = row.group(2).strip()
    return sections


def _keys(cls: type) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)}
    return names - _NOT_TOP_LEVEL_KEYS if cls is DatasetSpec else names


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return dataclasses.MISSING
    if isinstance(value, enum.Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_key_of_a_section_is_documented_and_nothing_else(section):
    tables = documented(DOC.read_text())
    assert section in tables, f"docs/datasets.md has no '#### {section}' section"
    keys = _keys(SECTIONS[section])
    assert set(tables[section]) == keys, (
        f"{section}: undocumented {sorted(keys - set(tables[section]))}, "
        f"not keys {sorted(set(tables[section]) - keys)}"
    )


@pytest.mark.parametrize("section", list(SECTIONS))
def test_documented_defaults_are_the_defaults(section):
    rows = documented(DOC.read_text())[section]
    for field in dataclasses.fields(SECTIONS[section]):
        if field.name not in rows:
            continue
        cell, default = rows[field.name], _default(field)
        if default is dataclasses.MISSING:
            assert cell == "required", f"{section} {field.name}: has no default, documented {cell!r}"
        elif default is None:
            assert cell == "none", f"{section} {field.name}: default None, documented {cell!r}"
        elif re.fullmatch(r"`[^`]*`", cell):
            assert tomllib.loads(f"v = {cell[1:-1]}")["v"] == default, f"{section} {field.name}: {cell}"


def test_the_parser_finds_keys_and_skips_code():
    text = "#### `[x]`\n\n| key | default | meaning |\n|---|---|---|\n| `a` | `1` | one |\n```\n| `b` | 2 |\n```\n"
    assert documented(text) == {"[x]": {"a": "`1`"}}
