"""The dataset a spec describes (``datasets/*.toml``): its schema, its readers and the split.

A spec's rows are read by a row source (streamed text, npy or Parquet, or rows in memory);
:mod:`recsys.data.split` divides them into training and held-out rows when the split sorts or groups
them, and :mod:`recsys.data.epochs` turns a split into epochs and rank shares (the rows a step sees do
not depend on the world size, and ``train_batches(start_step=k)`` resumes exactly).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsys.data.block import Block
from recsys.data.criteo import NUM_DENSE, NUM_SPARSE, CriteoParser
from recsys.data.epochs import SplitDataset
from recsys.data.fields import split_fields
from recsys.data.issues import Issues, OnError, Problems
from recsys.data.npy_source import NpySource
from recsys.data.row_sources import (
    WHOLE,
    MemorySource,
    ParquetSource,
    RowSource,
    Span,
    TextReading,
    TextSource,
)
from recsys.data.spec import (
    DatasetSpec,
    Format,
    JoinSpec,
    SourceSpec,
    SplitSpec,
    inside_root,
    path_problem,
    quoted,
)
from recsys.data.split import SplitKeys, check_split_columns, merge_keys, order_times, row_keys, split_rows
from recsys.data.stats import SplitStats, stats_of_source
from recsys.data.tabular import ArrowTable, SideTable, TextTable, needed_columns, to_block
from recsys.errors import UserError

__all__ = [
    "SpecDataset",
    "check_columns",
    "data_columns",
    "input_dataset",
    "scoring_dataset",
    "without_missing_label",
]

log = logging.getLogger("recsys")


def _features_only(spec: DatasetSpec) -> DatasetSpec:
    """``spec`` without ``order_by``: :func:`to_block` reads features, split keys are read apart."""
    return dataclasses.replace(spec, split=dataclasses.replace(spec.split, order_by=""))


@dataclass(frozen=True)
class TextParser:
    """A chunk of column-mapped delimited text (CSV/TSV, RecBole) → a block and its split keys
    (picklable: module level)."""

    spec: DatasetSpec
    delimiter: bytes
    columns: list[str]
    sides: list[SideTable]

    def __call__(self, data: bytes, first: int, issues: Issues) -> tuple[Block, SplitKeys | None]:
        fields = split_fields(
            data, delimiter=self.delimiter, num_fields=len(self.columns), first_line=first, issues=issues
        )
        table = TextTable(fields, self.columns)
        problems = Problems(fields.num_rows)
        block, _ = to_block(table, _features_only(self.spec), self.sides, problems)
        split = self.spec.split
        times = order_times(table, split, problems)
        keep = problems.resolve(fields.lines, issues)
        if keep is not None:
            idx = np.flatnonzero(keep)
            block, table = block.take(idx), TextTable(fields.keep(idx), self.columns)
            times = None if times is None else times[idx]
        return block, row_keys(
            table, order_by=split.order_by, group_by=split.group_by, where=issues.path, times=times
        )


def _expand(root: Path, names: tuple[str, ...], key: str) -> list[Path]:
    """Files relative to ``root``; glob patterns (``day_*``) expand in natural order (day_2 before day_10).

    Every name, and every glob match, must stay inside ``root`` once symlinks are resolved (``key`` names
    the spec key in the error): a spec is untrusted input and must not read files elsewhere.
    """
    out: list[Path] = []
    for name in names:
        if problem := path_problem(name):  # also checked when the spec is read; specs built in code too
            raise UserError(f"{key}: {quoted(name)} {problem}")
        if any(c in name for c in "*?["):
            matches = sorted(root.glob(name), key=_natural)
            if not matches:
                raise UserError(f"no files match {root / name}")
            out += [inside_root(root, m, f"{key} match") for m in matches]
        else:
            out.append(inside_root(root, root / name, key))
    return out


def _natural(path: Path) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _header(path: Path, delimiter: bytes) -> list[str]:
    from recsys.data.chunks import open_binary

    with open_binary(path) as fh:
        line = fh.readline().rstrip(b"\r\n")
    # RecBole typed headers: `user_id:token` names the column `user_id`.
    return [c.decode("utf-8", "replace").split(":", 1)[0] for c in line.split(delimiter)]


def _delimiter(spec: DatasetSpec) -> bytes:
    return spec.read.delimiter.encode() if spec.format is not Format.RECBOLE else b"\t"


def data_columns(spec: DatasetSpec, path: Path) -> list[str]:
    """The column names of a data file of ``spec``: ``[read] columns``, else its header line (RecBole's
    typed names without their type), a Parquet file's schema; empty for criteo_tsv and torchrec_npy.

    Raises:
        UserError: a text file without a header and no ``[read] columns``.
    """
    if spec.format in (Format.CRITEO_TSV, Format.TORCHREC_NPY, Format.SYNTHETIC):
        return []
    if spec.format is Format.PARQUET:
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
    if spec.read.columns:
        return list(spec.read.columns)
    if spec.read.header or spec.format is Format.RECBOLE:
        return _header(path, _delimiter(spec))
    raise UserError(f"{spec.path}: a file without a header needs [read] columns = [...]")


def _available_columns(spec: DatasetSpec, root: Path, main: Path) -> list[str]:
    """The columns the rows of data file ``main`` can read: its own (its header, ``[read] columns`` or
    Parquet schema), then each ``[[join]]`` side file's (its declared columns or its header; RecBole's
    ``.user`` / ``.item`` beside ``main`` when the spec names none). Headers only."""
    columns = data_columns(spec, main)
    sides = [(root / j.file, list(j.columns)) for j in spec.join]
    if spec.format is Format.RECBOLE and not sides:  # RecBole's own side files, as the reader joins them
        sides = [(main.with_suffix(suffix), []) for suffix in (".user", ".item")]
    for path, named in sides:
        if named or path.is_file():
            found = named or _header(inside_root(root, path, f"{spec.path} [[join]] file"), _delimiter(spec))
            columns += [c for c in found if c not in columns]
    return columns


def check_columns(spec: DatasetSpec, root: Path) -> None:
    """Refuse a field, label or ``order_by`` column that is neither in the first data file (its header,
    ``[read] columns`` or Parquet schema) nor in a ``[[join]]`` side file's header, in one line; reads
    headers only (the launcher calls it before any worker starts). Formats without named columns pass.

    Raises:
        UserError: the first missing column, with the columns there are.
    """
    if spec.format in (Format.CRITEO_TSV, Format.TORCHREC_NPY, Format.SYNTHETIC):
        return
    first = _expand(root, spec.source.files, "[source] files")[0]
    columns = _available_columns(spec, root, first)
    missing = sorted(c for c in needed_columns(spec) if c not in columns)
    if missing:
        joined = bool(spec.join) or spec.format is Format.RECBOLE
        raise UserError(
            f"{spec.path}: no column {missing[0]!r} in {first.name}"
            + (" or its [[join]] files" if joined else "")
            + f" (columns: {', '.join(columns)})"
        )


def without_missing_label(spec: DatasetSpec, root: Path, main: Path) -> DatasetSpec:
    """``spec``, read with ``[read] has_label = false`` when its label column is in neither the data
    file ``main`` (its header, ``[read] columns`` or Parquet schema) nor a ``[[join]]`` side file's
    header: data to score. Formats without named columns are returned as they are.
    """
    if not spec.read.has_label or spec.format in (Format.CRITEO_TSV, Format.TORCHREC_NPY, Format.SYNTHETIC):
        return spec
    if spec.label.column in _available_columns(spec, root, main):
        return spec
    return dataclasses.replace(spec, read=dataclasses.replace(spec.read, has_label=False))


def scoring_dataset(spec: DatasetSpec, *, root: Path, seed: int, on_error: OnError) -> SpecDataset:
    """The dataset of ``spec`` over ``root`` for scoring: read without labels when its files lack the
    label column (:func:`without_missing_label`, judged by the first file)."""
    files = _expand(root, spec.source.files, f"{spec.path} [source] files")
    if files and spec.read.has_label and files[0].is_file():
        spec = without_missing_label(spec, root, files[0])
    return SpecDataset(spec, root=root, seed=seed, on_error=on_error)


def input_dataset(spec: DatasetSpec, files: list[Path], *, on_error: OnError = OnError.RAISE) -> SpecDataset:
    """Every row of ``files`` (anywhere) read with ``spec``'s layout and transforms, as the training
    split of a dataset without held-out rows (for scoring new data). Its ``[source]`` and ``[split]``
    are not used; side files (``[[join]]``) are looked up in the folder that holds the files. The label
    is read when the files have its column (:func:`without_missing_label`).

    Raises:
        UserError: a file that does not exist, or data the spec cannot read.
    """
    if not files:
        raise UserError("no input files")
    paths = [p.resolve() for p in files]
    for p in paths:
        if not p.is_file() and not Path(f"{p}_labels.npy").exists():
            raise UserError(f"input file not found: {p}")
    root = Path(os.path.commonpath([p.parent for p in paths]))
    names = tuple(glob.escape(p.relative_to(root).as_posix()) for p in paths)
    spec = dataclasses.replace(
        spec,
        source=SourceSpec(files=names),
        split=SplitSpec(eval_fraction=0.0),
        path=spec.path or "the bundle's spec",
    )
    return scoring_dataset(spec, root=root, seed=0, on_error=on_error)


class SpecDataset(SplitDataset):
    """The Dataset a spec describes, over files in ``root``.

    Args:
        spec: the parsed spec.
        root: folder holding the spec's files.
        seed: fixes the per-epoch shuffle.
        on_error: what to do with malformed lines.
    """

    def __init__(
        self, spec: DatasetSpec, *, root: Path, seed: int, on_error: OnError = OnError.RAISE
    ) -> None:
        self.spec = spec
        self.root = root
        self.seed = seed
        self.shuffle = spec.split.shuffle
        self.on_error = on_error
        self._sides: list[SideTable] = []
        self._columns: list[str] = []
        self._stats: dict[str, SplitStats] | None = None
        files = _expand(root, spec.source.files, f"{spec.path} [source] files")
        eval_files = _expand(root, spec.split.eval_files, f"{spec.path} [split] eval_files")
        for f in [*files, *eval_files]:
            if spec.format is Format.TORCHREC_NPY:  # `files` are prefixes of three .npy files each
                for kind in ("dense", "sparse", "labels"):
                    inside_root(root, Path(f"{f}_{kind}.npy"), f"{spec.path} [source] files")
            if not f.exists() and not Path(f"{f}_labels.npy").exists():
                raise UserError(f"{spec.path}: data file not found: {f}")
        if not files:
            raise UserError(f"{spec.path}: [source] files is empty")
        self._names, self._spaces, self._num_dense = self._schema(files)
        self._files = [*files, *eval_files]
        self._train, self._eval = self._splits(files, eval_files)

    # -- schema -----------------------------------------------------------------------------------

    def _schema(self, files: list[Path]) -> tuple[list[str], list[int], int]:
        spec = self.spec
        if spec.format is Format.CRITEO_TSV:
            names = [s.name for s in spec.sparse] or [f"cat_{i}" for i in range(NUM_SPARSE)]
            if len(names) != NUM_SPARSE:
                raise UserError(
                    f"{spec.path}: criteo_tsv has {NUM_SPARSE} sparse features, the spec names {len(names)}"
                )
            spaces = [spec.id_space(s) for s in spec.sparse] or [1 << 32] * NUM_SPARSE
            return names, spaces, NUM_DENSE
        if spec.format is Format.TORCHREC_NPY:
            probe = NpySource(files[:1])
            names = [s.name for s in spec.sparse] or [f"cat_{i}" for i in range(probe.num_sparse)]
            spaces = [spec.id_space(s) for s in spec.sparse] or [1 << 32] * probe.num_sparse
            if len(names) != probe.num_sparse:
                raise UserError(
                    f"{spec.path}: the npy files have {probe.num_sparse} sparse features, the spec names {len(names)}"
                )
            return names, spaces, probe.num_dense
        return [s.name for s in spec.sparse], [spec.id_space(s) for s in spec.sparse], len(spec.dense)

    @property
    def num_dense(self) -> int:
        return self._num_dense

    # -- readers ----------------------------------------------------------------------------------

    def _source(self, files: list[Path], span: Span = WHOLE) -> RowSource:
        """A reader of ``span`` of ``files``; its blocks' origins number them from ``span.first_file``
        (see origin_files)."""
        spec = self.spec
        if spec.format is Format.CRITEO_TSV:
            parse = CriteoParser(spec.read.has_label, tuple(spec.id_space(s) for s in spec.sparse))
            return TextSource(files, parse, on_error=self.on_error, span=span)
        if spec.format is Format.TORCHREC_NPY:
            return NpySource(files, span=span, on_error=self.on_error, dense=spec.dense)
        if spec.format is Format.PARQUET:
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise UserError("format 'parquet' needs pyarrow: pip install 'tierrec[parquet]'") from None

            features = _features_only(spec)

            def convert(batch: Any, first_row: int, path: Path) -> tuple[Block, SplitKeys | None]:
                table = ArrowTable(batch, first_row)
                problems = Problems(table.num_rows)
                block, _ = to_block(table, features, self._sides, problems)
                times = order_times(table, spec.split, problems)
                keep = problems.resolve(table.lines, Issues(str(path), self.on_error))
                keys = row_keys(
                    table,
                    order_by=spec.split.order_by,
                    group_by=spec.split.group_by,
                    where=str(path),
                    times=times,
                )
                if keep is None:
                    return block, keys
                idx = np.flatnonzero(keep)
                return block.take(idx), (None if keys is None else keys[idx])

            return ParquetSource(files, convert, span=span)
        # csv / recbole: column-mapped delimited text.
        delimiter = _delimiter(spec)
        columns = data_columns(spec, files[0])

        parse = TextParser(spec, delimiter, columns, self._sides)
        return TextSource(
            files,
            parse,
            on_error=self.on_error,
            span=span,
            reading=TextReading(header=self.spec.read.header),
        )

    def _load_sides(self, main: Path) -> None:
        spec = self.spec
        joins = list(spec.join)
        if spec.format is Format.RECBOLE and not joins:
            for suffix, key in ((".user", "user_id"), (".item", "item_id")):
                side = main.with_suffix(suffix)
                if side.is_file():
                    # Relative to the root: the .inter file may sit in a subfolder of it.
                    joins.append(JoinSpec(file=str(side.relative_to(self.root)), on=key))
        delimiter = _delimiter(spec)
        for i, join in enumerate(joins):
            what = f"{spec.path} [[join]] #{i + 1} file"
            if problem := path_problem(join.file):
                raise UserError(f"{what}: {quoted(join.file)} {problem}")
            path = inside_root(self.root, self.root / join.file, what)
            if not path.is_file():
                raise UserError(f"{spec.path}: join file not found: {path}")
            data = path.read_bytes()
            if join.columns:
                columns = list(join.columns)
            else:
                columns = _header(path, delimiter)
                data = data[data.index(b"\n") + 1 :] if b"\n" in data else b""
            if not data.endswith(b"\n"):
                data += b"\n"
            issues = Issues(str(path), self.on_error)
            fields = split_fields(
                data,
                delimiter=delimiter,
                num_fields=len(columns),
                first_line=1 if join.columns else 2,
                issues=issues,
            )
            problems = Problems(fields.num_rows)
            side = SideTable(
                TextTable(fields, columns), on=join.on, path=str(path), spec=spec, problems=problems
            )
            problems.resolve(fields.lines, issues)
            self._sides.append(side)

    # -- splits -----------------------------------------------------------------------------------

    def _splits(self, files: list[Path], eval_files: list[Path]) -> tuple[RowSource, RowSource]:
        spec = self.spec
        if spec.format in (Format.CSV, Format.RECBOLE):
            self._load_sides(files[0])
        if eval_files:
            train, held = self._source(files), self._source(eval_files, Span(first_file=len(files)))
            if spec.split.shuffle:
                train = MemorySource(Block.concat(list(train.blocks())))
            return train, held
        split = spec.split
        if split.order_by or split.group_by or split.shuffle:  # the whole split in memory
            whole = self._source(files)
            if split.order_by or split.group_by:
                self._check_split_columns(files)
            blocks, keys = [], []
            for block, key in whole.pairs():  # type: ignore[union-attr]
                blocks.append(block)
                keys.append(key)
            if not blocks:
                raise UserError(f"{spec.path}: no rows in {', '.join(map(str, files))}")
            block = Block.concat(blocks)
            if split.order_by or split.group_by:
                train_rows, held_rows = split_rows(
                    merge_keys(keys, split.order_by), block.num_rows, split.eval_fraction
                )
                return MemorySource(block.take(train_rows)), MemorySource(block.take(held_rows))
            cut = block.num_rows - round(block.num_rows * split.eval_fraction)
            return MemorySource(block.slice(0, cut)), MemorySource(block.slice(cut, block.num_rows))
        whole = self._source(files)
        total = whole.total_lines() if isinstance(whole, TextSource) else whole.num_rows()
        cut = total - round(total * spec.split.eval_fraction)
        return self._source(files, Span(0, cut)), self._source(files, Span(cut, total))

    def _check_split_columns(self, files: list[Path]) -> None:
        """Refuse an ``order_by`` / ``group_by`` column the data lacks before parsing (one line)."""
        columns = data_columns(self.spec, files[0])
        check_split_columns(self.spec.split, where=self.spec.path, columns=columns, sides=self._sides)

    # -- the Dataset protocol ---------------------------------------------------------------------

    def split_stats(self) -> dict[str, SplitStats]:
        """Rows and positives of ``"train"`` and ``"eval"``, counted once and kept.

        Exact: splits held in memory (sorted, grouped or shuffled) are counted there; a streamed split
        costs one pass over its files (a full parse, so the rows ``on_error = "skip"`` drops are not
        counted, as training does not see them).
        """
        if self._stats is None:
            self._stats = {"train": stats_of_source(self._train), "eval": stats_of_source(self._eval)}
        return self._stats

    @property
    def origin_files(self) -> list[Path]:
        """The files the blocks' origins number: ``[source] files`` then ``[split] eval_files``, expanded."""
        return self._files

    def columns(self) -> list[str]:
        """The column names of the data files (the first file's header or ``[read] columns``; a Parquet
        file's schema); empty for formats without named columns (criteo_tsv, torchrec_npy)."""
        return data_columns(self.spec, self._files[0])

    @property
    def train_source(self) -> RowSource:
        return self._train

    @property
    def eval_source(self) -> RowSource:
        return self._eval
