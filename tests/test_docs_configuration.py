"""docs/configuration.md documents every config key of a run with its default, and the CLI's flags.

The reference is the run config itself: the sections of :class:`recsys.config.RunConfig`, walked
recursively — a field whose type is a dataclass is a section of its own (``[a.b]``), and a field that maps
names to a dataclass is one too, written with a placeholder (``[store.capacity.<feature>]``). Each section
is a ``##`` or ``###`` heading `` `[section]` `` followed by a table whose rows start with
``| `key` | default | …``. A default written as a TOML value in backticks must be the dataclass's default
(enums as their values, tuples as lists); ``none`` stands for None. Every flag of ``recsys train``,
``preprocess``, ``tune-cache``, ``plan-exchange`` and ``plot`` must have a row under its ``### `recsys <command>` `` heading.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import pytest

from recsys.cli import build_parser
from recsys.config import RunConfig
from tests.recsys.data.test_datasets_doc import _default  # the same rule: enums as values, tuples as lists

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# The commands whose flags must each have a row under their "### `recsys <command>`" heading.
COMMANDS = ("train", "preprocess", "tune-cache", "plan-exchange", "plot")

_HEADING = re.compile(r"^(#{2,3})\s+(.*?)\s*$")
_SECTION = re.compile(r"^`\[([A-Za-z0-9_.<>-]+)\]`")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|([^|]*)\|")
_PLACEHOLDER = re.compile(r"<[^>]*>")


def _normal(section: str) -> str:
    """``store.capacity.<feature>`` and ``store.capacity.<name>`` are the same section."""
    return _PLACEHOLDER.sub("<key>", section)


def documented(text: str) -> dict[str, dict[str, str]]:
    """{heading: {first cell without backticks: second cell}} of every ``##``/``###`` section.

    A heading `` `[section]` `` is keyed by the section name (``store.capacity.<key>``); any other by its
    text. Fenced code blocks are skipped.
    """
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if heading := _HEADING.match(line):
            title = heading.group(2)
            name = _normal(m.group(1)) if (m := _SECTION.match(title)) else title
            current = sections.setdefault(name, {})
            continue
        if line.startswith("#"):
            current = None
            continue
        if current is not None and (row := _ROW.match(line)):
            current[row.group(1)] = row.group(2).strip()
    return sections


def _dataclass_of(annotation: object) -> tuple[type, bool] | None:
    """(the dataclass, whether it is the value type of a mapping) of a field's annotation, else None."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation, False
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and dataclasses.is_dataclass(value):
            return value, True
    return None


def config_sections(cls: type = RunConfig, prefix: str = "") -> dict[str, type]:
    """{section name: dataclass} of every section of a run config, nested ones included."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        found = _dataclass_of(hints[field.name])
        if found is None:
            continue
        sub, mapping = found
        name = f"{prefix}{field.name}" + (".<key>" if mapping else "")
        out[name] = sub
        out |= config_sections(sub, f"{name}.")
    return out


def problems(text: str) -> list[str]:
    """What docs/configuration.md lacks or gets wrong, one line each (empty: complete)."""
    tables = documented(text)
    out = []
    for section, cls in config_sections().items():
        if section not in tables:
            out.append(f"no '## `[{section}]`' section")
            continue
        rows = tables[section]
        for field in dataclasses.fields(cls):
            if field.name not in rows:
                out.append(f"[{section}] {field.name}: undocumented")
                continue
            cell, default = rows[field.name], _default(field)
            if default is dataclasses.MISSING:
                ok = cell == "required"
            elif default is None:
                ok = cell == "none"
            elif re.fullmatch(r"`[^`]*`", cell):
                try:
                    ok = tomllib.loads(f"v = {cell[1:-1]}")["v"] == default
                except tomllib.TOMLDecodeError:
                    ok = False
            else:
                ok = False
            if not ok:
                out.append(
                    f"[{section}] {field.name}: documented default {cell!r}, the default is {default!r}"
                )
        names = {f.name for f in dataclasses.fields(cls)}
        out += [f"[{section}] {key}: not a key" for key in sorted(set(rows) - names)]
    return out


def _flags(command: str) -> set[str]:
    """The long option of every flag of ``recsys <command>`` but ``--help``."""
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    actions = sub.choices[command]._actions  # type: ignore[attr-defined]
    return {a.option_strings[-1] for a in actions if a.option_strings and "--help" not in a.option_strings}


def test_every_config_key_is_documented_with_its_default():
    found = problems(DOC.read_text(encoding="utf-8"))
    assert not found, "docs/configuration.md:\n" + "\n".join(found)


def test_the_walk_reaches_nested_sections():
    sections = config_sections()
    assert {"train", "eval", "model", "sparse", "store", "pipeline", "data", "synthetic"} <= set(sections)
    assert "store.capacity.<key>" in sections


def test_a_missing_row_or_a_wrong_default_is_reported():
    text = DOC.read_text(encoding="utf-8")
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| `steps` |"))
    assert "[train] steps: undocumented" in problems(without)
    changed = text.replace("| `lookahead` | `4` |", "| `lookahead` | `5` |")
    assert any(p.startswith("[store] lookahead: documented default") for p in problems(changed))
    nested = "\n".join(line for line in text.splitlines() if not line.startswith("| `host` | none |"))
    assert "[store.capacity.<key>] host: undocumented" in problems(nested)


def test_the_parser_finds_rows_and_skips_code():
    text = "## `[x.<f>]`\n\n| key | default |\n|---|---|\n| `a` | `1` |\n```\n| `b` | 2 |\n```\n"
    assert documented(text) == {"x.<key>": {"a": "`1`"}}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_command_is_documented(command):
    rows = documented(DOC.read_text(encoding="utf-8")).get(f"`recsys {command}`")
    assert rows is not None, f"docs/configuration.md has no '### `recsys {command}`' section"
    documented_flags = {cell.split()[0] for cell in rows}
    missing = sorted(_flags(command) - documented_flags)
    assert not missing, f"recsys {command}: flags not in docs/configuration.md: {missing}"
