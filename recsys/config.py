"""TOML configuration mapped onto the components' own dataclasses.

Every component owns a small keyword-only, frozen config dataclass that validates itself in
``__post_init__``. A run's :class:`RunConfig` is the set of those sections; this module only maps TOML
tables and ``--set section.key=value`` overrides onto them, with errors that name the offending key
or value and list what would have been valid.

Example:
    >>> cfg = load_config("configs/quickstart.toml", overrides=["train.steps=10"])
    >>> cfg.train.steps
    10
"""

from __future__ import annotations

import dataclasses
import enum
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from recsys.data.source import DataConfig
from recsys.data.spec import read_text
from recsys.data.synthetic_config import SyntheticConfig
from recsys.errors import UserError
from recsys.model_config import ModelConfig
from recsys.pipeline_config import PipelineSection
from recsys.sparse import SparseConfig
from recsys.store_config import StoreSection
from recsys.train_config import EvalConfig, TrainConfig

__all__ = ["ConfigError", "RunConfig", "config_from_dict", "config_to_dict", "load_config", "parse_override"]


class ConfigError(UserError):
    """A user error in a config file or an override; the message is one line and names the culprit."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class RunConfig:
    """A whole training run: one field per section of the TOML file."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    sparse: SparseConfig = dataclasses.field(default_factory=SparseConfig)
    store: StoreSection = dataclasses.field(default_factory=StoreSection)
    pipeline: PipelineSection = dataclasses.field(default_factory=PipelineSection)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.model.name.value != "logistic" and self.model.embedding_dim != self.model.dense_arch[-1]:
            raise ValueError(
                f"model.dense_arch must end with model.embedding_dim ({self.model.embedding_dim}) "
                f"for DLRM interactions, got {list(self.model.dense_arch)}"
            )
        if self.train.batch_size % self.train.nproc:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be divisible by train.nproc "
                f"({self.train.nproc}): it is the global batch, split evenly across ranks"
            )


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def _is_table_type(annotation: Any) -> bool:
    """Whether TOML gives ``annotation`` as a table: a dict or a config dataclass."""
    return typing.get_origin(annotation) is dict or (
        isinstance(annotation, type) and dataclasses.is_dataclass(annotation)
    )


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a TOML value to the annotated field type, or raise ConfigError naming ``where``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                # The message of the arm the value was meant for: a table's for a table, else a scalar's
                # (``admit_after = 2.5`` is "must be an integer", not "must be a table of keys").
                if _is_table_type(arg) == isinstance(value, dict):
                    errors.insert(0, str(err))
                else:
                    errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of keys, got {value!r}")
        return {str(k): _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of keys, got {value!r}")
        return _build_section(where, annotation, value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        item_type = args[0] if args else Any
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        allowed = [m.value for m in annotation]
        if isinstance(value, annotation):
            return value
        if isinstance(value, str) and value.lower() in allowed:
            return annotation(value.lower())
        raise ConfigError(f"{where} must be one of {allowed}, got {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if annotation is Any:
        return value
    raise ConfigError(f"{where}: unsupported field type {annotation!r}")


def _shown(text: str) -> str:
    """User text inside a one-line message: escaped (``\\n``, ``\\x00``) when it is not printable."""
    return text if text.isprintable() else repr(text)[1:-1]


def _build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in valid:
            raise ConfigError(
                f"unknown config key '{name}.{_shown(key)}'; valid keys of [{name}]: {', '.join(valid)}"
            )
        kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ConfigError(f"[{name}] {err}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one ``section.key=value`` override; the value is read as TOML when it parses as TOML.

    >>> parse_override("train.steps=10")
    ('train', 'steps', 10)
    >>> parse_override("model.name=dcn")
    ('model', 'name', 'dcn')
    """
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def config_from_dict(tree: dict[str, Any], overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Build a RunConfig from a parsed TOML tree plus ``--set`` overrides."""
    sections = _section_types()
    merged: dict[str, dict[str, Any]] = {}
    for name, values in tree.items():
        if name not in sections:
            raise ConfigError(
                f"unknown config section [{_shown(name)}]; valid sections: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {values!r}")
        merged[name] = dict(values)
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in sections:
            raise ConfigError(
                f"unknown config section '{_shown(section)}' in --set {text!r}; "
                f"valid sections: {', '.join(sections)}"
            )
        merged.setdefault(section, {})[key] = value
    built = {name: _build_section(name, cls, merged.get(name, {})) for name, cls in sections.items()}
    try:
        return RunConfig(**built)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read a TOML config file and apply ``--set`` overrides."""
    path = Path(path)
    text = read_text(path, "config file", ConfigError)  # missing, a folder, unreadable, not UTF-8: one line
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return config_from_dict(tree, overrides)


def config_to_dict(cfg: Any) -> Any:
    """A JSON/TOML-friendly view of a config (enums as their values, tuples as lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, tuple | list):
        return [config_to_dict(v) for v in cfg]
    return cfg
