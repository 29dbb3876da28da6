"""The serving bundle: what ``recsys export`` writes and :func:`recsys.serving.load_bundle` reads.

Layout of a bundle directory (no pickle anywhere: JSON, safetensors and raw float32 rows in LMDB)::

    manifest.json        format name and version, size and BLAKE2b checksum of every other file
    model.json           the model (architecture, features, tables, initialisation) and the training config
    dense.safetensors    dense parameters under their checkpoint state-dict names
    tables.safetensors   plain tables: ``<table>.weight`` (rows, dim) [and ``<table>.state``]
    tiered/data.mdb      tiered tables: one LMDB named DB per table, 8-byte big-endian id keys in
                         ascending order, values the packed float32 row (weights [then optimizer state])

The file set is fixed (:data:`FILES`), so a manifest can never name a file outside the bundle, and a
symbolic link anywhere in the bundle (``tiered/data.mdb -> /elsewhere/data.mdb``, ``tiered -> ...``) is
refused, as is any file that resolves outside the bundle's folder. Reading a bundle checks that every
file is there, a regular file, has its recorded size and (``verify=True``) its checksum, and that nothing
else is there; any problem is one :class:`BundleError` line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedding_store.config import MAX_ID, TableSpec, WeightsPrecision
from recsys.errors import UserError
from recsys.table_names import table_name

__all__ = [
    "FORMAT",
    "VERSION",
    "FILES",
    "Bundle",
    "BundleError",
    "FeatureSpec",
    "describe_files",
    "file_digest",
    "read_bundle",
]

FORMAT = "tierrec-serving-bundle"
# Version 3: the layout above; model.json records the order in which the model's interaction consumes
# the sparse features (``interaction_order``, since version 2) and the weights' precision
# (``weights_precision``: fp32, or fp16 weights two to a 4-byte word of a stored row and as F16 plain
# tables). Version 2 bundles are read as fp32 (a tierrec that reads version 2 only would misread fp16
# rows, so every bundle is written as version 3). Version 1 bundles listed the features in the
# checkpoint's sorted key order, which is not the model's: a reader refuses any other version rather
# than guess at its meaning.
VERSION = 3
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
MODEL, DENSE, TABLES, TIERED = "model.json", "dense.safetensors", "tables.safetensors", "tiered/data.mdb"
FILES = (MODEL, DENSE, TABLES, TIERED)
_CHUNK = 1 << 20
_MODELS = ("dlrm", "dcn", "logistic")
_KINDS = ("plain", "tiered")


class BundleError(UserError):
    """A bundle that is incomplete, altered, of another format version or inconsistent (one line)."""


def file_digest(path: Path) -> str:
    """BLAKE2b (16 bytes, hex) of a file, read in chunks: a tiered table may be larger than memory."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries ``{name: {"bytes", "blake2b"}}`` of files of ``root``."""
    return {n: {"bytes": (root / n).stat().st_size, "blake2b": file_digest(root / n)} for n in names}


@dataclass(kw_only=True, frozen=True, slots=True)
class FeatureSpec:
    """One sparse feature of the model and its sum-pooled table.

    Attributes:
        name: the feature (a key of the scorer's sparse input).
        table: its table's name (``t_<feature>``), also the init stream key of its rows.
        kind: ``plain`` (all rows in ``tables.safetensors``; ids are folded modulo ``rows``, as training
            folds them) or ``tiered`` (rows in ``tiered/data.mdb``, raw ids).
        dim: embedding dimension.
        rows: plain: the table's rows; tiered: the rows stored (ids ever touched in training). A bounded
            table's: the rows the bounds kept and its default row.
        id_space: tiered: ids must lie in ``[0, id_space)``; None for raw 64-bit ids.
        default_id: a bounded table's default row id (:mod:`recsys.serving.bounded`): every id without a
            row of its own reads that row; plain: also the modulus its ids are folded by. None: not bounded.
    """

    name: str
    table: str
    kind: str
    dim: int
    rows: int
    id_space: int | None = None
    default_id: int | None = None


@dataclass(frozen=True, slots=True)
class Bundle:
    """A bundle whose files were checked against its manifest, and its parsed ``model.json``."""

    path: Path
    model: dict[str, Any]
    features: tuple[FeatureSpec, ...]

    @property
    def arch(self) -> dict[str, Any]:
        """The ``[model]`` settings: name, embedding_dim, dense_arch, over_arch, dcn_* ."""
        return self.model["model"]

    @property
    def num_dense(self) -> int:
        return int(self.model["num_dense"])

    @property
    def init(self) -> tuple[int, float]:
        """``(seed, scale)`` of the deterministic initial rows (:func:`embedding_store.init_rows`)."""
        return int(self.model["init"]["seed"]), float(self.model["init"]["scale"])

    @property
    def row_floats(self) -> int:
        """4-byte words per stored tiered row: the weights, then the optimizer state when it was kept."""
        return int(self.model["row_floats"])

    @property
    def weights_precision(self) -> WeightsPrecision:
        """How the tables hold their weights (read_bundle checked the value; version 2 bundles: fp32)."""
        return WeightsPrecision(self.model.get("weights_precision", WeightsPrecision.FP32.value))

    def file(self, name: str) -> Path:
        return self.path / name


def _fail(path: Path, problem: str) -> BundleError:
    return BundleError(f"bundle {path}: {problem}")


def _listed_files(path: Path) -> set[str]:
    """Every non-folder entry under ``path``, relative, as manifest names; a symbolic link (to a file or a
    folder, inside the bundle or not) or anything but a regular file is refused: a bundle serves only
    its own files."""
    found = set()
    for here, dirs, names in os.walk(path):
        rel = Path(here).relative_to(path)
        for name in sorted(dirs + names):
            entry = Path(here) / name
            if entry.is_symlink():
                raise _fail(
                    path,
                    f"{(rel / name).as_posix()} is a symbolic link (to {os.readlink(entry)}); "
                    "a bundle serves only files inside it",
                )
            if name in names and not entry.is_file():
                raise _fail(path, f"{(rel / name).as_posix()} is not a regular file")
        found |= {(rel / n).as_posix() for n in names}
    return found


def _outside(path: Path, name: str) -> bool:
    """Whether ``path/name`` resolves (symlinks included) anywhere but inside bundle ``path``."""
    try:
        return not (path / name).resolve(strict=True).is_relative_to(path.resolve(strict=True))
    except (OSError, RuntimeError):  # gone meanwhile, or a symlink loop
        return True


def _check_manifest(path: Path, verify: bool) -> dict[str, Any]:
    if (path / MANIFEST).is_symlink():
        raise _fail(path, f"{MANIFEST} is a symbolic link; a bundle serves only files inside it")
    try:
        text = (path / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(path, f"incomplete: {MANIFEST} is missing (was the export interrupted?)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise _fail(path, f"unreadable {MANIFEST} ({err})") from None
    try:
        manifest = json.loads(text)
    except ValueError:
        raise _fail(path, f"{MANIFEST} is not JSON (altered?)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        what = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise _fail(path, f"{MANIFEST} is not a serving bundle's (format {str(what)[:40]!r}, not {FORMAT!r})")
    version = manifest.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise _fail(
            path,
            f"format version {version!r}, but this tierrec reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; "
            "export the checkpoint again with `recsys export`",
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise _fail(path, f"{MANIFEST} lists no files (altered?)")
    unknown = sorted(str(n) for n in files if n not in FILES)
    if unknown:
        raise _fail(path, f"{MANIFEST} lists {unknown[0]!r}, which is not a bundle file (altered?)")
    for name in (MODEL, DENSE, TABLES):
        if name not in files:
            raise _fail(path, f"{MANIFEST} does not list {name} (altered?)")
    present = _listed_files(path)
    extra = sorted(present - set(files) - {MANIFEST})
    if extra:
        raise _fail(path, f"{extra[0]} is not listed in {MANIFEST} (altered?)")
    for name, entry in files.items():
        file = path / name
        if name not in present:
            raise _fail(path, f"incomplete: {name} is missing")
        if _outside(path, name):
            raise _fail(path, f"{name} resolves outside the bundle; a bundle serves only files inside it")
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            raise _fail(path, f"{MANIFEST} entry of {name} is malformed (altered?)")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise _fail(
                path, f"{name} is truncated or altered ({size} bytes, the manifest says {entry['bytes']})"
            )
        if verify and file_digest(file) != entry.get("blake2b"):
            raise _fail(path, f"{name} is altered (checksum mismatch)")
    return manifest


def _check_default(path: Path, spec: FeatureSpec) -> None:
    """A bounded feature's default row id lies in its table's ids: below the id space (tiered) or at
    least 1 (plain: the modulus of its ids), and the table holds at least that row."""
    d = spec.default_id
    if d is None:
        return
    top = spec.id_space if spec.kind == "tiered" and spec.id_space is not None else MAX_ID + 1
    low = 1 if spec.kind == "plain" else 0
    if not isinstance(d, int) or isinstance(d, bool) or not low <= d < top:
        raise _fail(
            path, f"{MODEL}: feature {spec.name!r} names default row id {d!r}, outside [{low}, {top})"
        )
    if spec.rows < 1:
        raise _fail(
            path, f"{MODEL}: bounded feature {spec.name!r} holds {spec.rows} rows, not even its default row"
        )


def _features(path: Path, model: dict[str, Any], has_tiered: bool) -> tuple[FeatureSpec, ...]:
    out = []
    for i, raw in enumerate(model.get("features") or []):
        try:
            spec = FeatureSpec(**raw)
        except TypeError:
            raise _fail(path, f"{MODEL}: feature #{i} is malformed: {str(raw)[:80]}") from None
        if spec.kind not in _KINDS or spec.dim < 1 or spec.rows < 0:
            raise _fail(
                path,
                f"{MODEL}: feature {spec.name!r} has kind {spec.kind!r}, dim {spec.dim}, rows {spec.rows}",
            )
        _check_default(path, spec)
        out.append(spec)
    if not out:
        raise _fail(path, f"{MODEL} lists no features")
    order = model.get("interaction_order")
    names = [f.name for f in out]
    if (
        not isinstance(order, list)
        or sorted(map(str, order)) != sorted(names)
        or len(set(names)) != len(names)
    ):
        raise _fail(
            path,
            f"{MODEL}: the interaction order {str(order)[:80]} does not name each of the features {names[:8]} "
            "once; export the checkpoint again with `recsys export`",
        )
    bad = [f.name for f in out if f.table != table_name(f.name)]
    if bad:
        raise _fail(path, f"{MODEL}: feature {bad[0]!r} is not served by its table t_{bad[0]} (altered?)")
    position = {name: i for i, name in enumerate(order)}
    out.sort(key=lambda f: position[f.name])  # the scorer stacks pooled embeddings in this order
    if any(f.kind == "tiered" for f in out) and not has_tiered:
        raise _fail(path, f"incomplete: the model has tiered tables but the manifest lists no {TIERED}")
    return tuple(out)


def read_bundle(path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
    """Check a bundle against its manifest and parse its ``model.json``.

    ``verify=False`` checks presence and sizes only, not checksums (reading every byte of a large
    tiered table takes about a second per GB).

    Raises:
        BundleError: one line naming the problem (missing or unlisted file, size or checksum mismatch,
            another format version, a malformed ``model.json``).
    """
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"bundle {path} is not a directory")
    manifest = _check_manifest(path, verify)
    try:
        model = json.loads((path / MODEL).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise _fail(path, f"unreadable {MODEL} ({err})") from None
    if not isinstance(model, dict):
        raise _fail(path, f"{MODEL} is not a JSON object")
    for key in ("model", "num_dense", "features", "init", "row_floats"):
        if key not in model:
            raise _fail(path, f"{MODEL} lacks {key!r}")
    name = model["model"].get("name") if isinstance(model["model"], dict) else None
    if name not in _MODELS:
        raise _fail(path, f"{MODEL}: unknown model {name!r}; known: {', '.join(_MODELS)}")
    precision = model.get("weights_precision", WeightsPrecision.FP32.value)
    if precision not in {p.value for p in WeightsPrecision} or (
        manifest["version"] < 3 and precision != WeightsPrecision.FP32.value
    ):
        raise _fail(path, f"{MODEL}: weights_precision {str(precision)[:40]!r} is not one this tierrec reads")
    features = _features(path, model, TIERED in manifest["files"])
    _check_row_words(path, model, features, WeightsPrecision(precision))
    return Bundle(path, model, features)


def _check_row_words(
    path: Path, model: dict[str, Any], features: tuple[FeatureSpec, ...], precision: WeightsPrecision
) -> None:
    """Tiered rows hold the weights in ``precision`` (fp16: two a 4-byte word), then the optimizer state
    when it was kept: ``row_floats`` words. A row size that does not fit is refused, never misread."""
    optimizer = model.get("optimizer")
    state = optimizer.get("state_floats", 0) if isinstance(optimizer, dict) and optimizer.get("kept") else 0
    for f in features:
        if f.kind != "tiered":
            continue
        words = TableSpec(name=f.table, dim=f.dim, weights_precision=precision).weight_words
        if model["row_floats"] != words + state:
            raise _fail(
                path,
                f"{MODEL}: row_floats {model['row_floats']!r} do not fit {f.dim} {precision.value} weights"
                f"{f' and {state} floats of optimizer state' if state else ''} (altered?)",
            )
