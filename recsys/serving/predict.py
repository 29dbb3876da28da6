"""``recsys predict``: stream data through a bundle's scorer and write one score per input row.

The data is a split of the bundle's own training data (``--split eval``, default; ``train``; ``all``,
training rows first), of another config or dataset spec, or new files read with the training spec's
layout (``--input``: every row, no split). Rows are read and scored batch by batch and written as they
come, so memory stays bounded by a batch (and, for Parquet, one row group).

Each output row says where its input row is — ``file`` (relative to the data's folder) and ``line``
(the 1-based line of a text file, header included; the row of a Parquet or npy file), so that rows
skipped as malformed shift nothing and sorted or grouped splits map back — or, for generated data,
``row`` (its index in the split); then the ``--keep`` columns of the input row (as text, as the file
has them), its label when the data has one, the logit and the click probability (``score``).

A bundle is read and checked before anything else is imported: a damaged one is refused in a moment.
TorchRec is not imported (the readers make numpy blocks; only a ``module:function`` factory's batches
need it).
"""

from __future__ import annotations

import contextlib
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recsys.errors import UserError
from recsys.serving.bundle import read_bundle
from recsys.serving.output import remove_stale, write_failure
from recsys.serving.score_file import ScoreFile, out_kind

if TYPE_CHECKING:
    from recsys.config import RunConfig
    from recsys.data.block import Block
    from recsys.data.row_sources import RowSource
    from recsys.data.source import Dataset
    from recsys.data.spec import DatasetSpec
    from recsys.serving.bundle import Bundle

__all__ = ["predict", "SPLITS"]

SPLITS = ("eval", "train", "all")
_OWN_COLUMNS = ("file", "line", "row", "split", "label", "logit", "score")


def _config(bundle_config: dict[str, Any], data: str | None, overrides: list[str]) -> RunConfig:
    """The run config whose data to score: the bundle's, another config file's, or a spec in its place."""
    from recsys.config import RunConfig, config_from_dict

    tree = {k: dict(v) for k, v in bundle_config.items() if isinstance(v, dict)}
    if data is not None:
        path = Path(data)
        parsed: dict[str, Any] | None = None
        if path.suffix == ".toml" and path.is_file():
            with contextlib.suppress(tomllib.TOMLDecodeError, OSError):
                parsed = tomllib.loads(path.read_text(encoding="utf-8"))
        sections = set(RunConfig.__dataclass_fields__)
        if parsed is not None and parsed and set(parsed) <= sections and "source" not in parsed:
            # A run config: its data, synthetic data and seed; the model is the bundle's.
            tree = {k: dict(v) for k, v in parsed.items() if isinstance(v, dict)}
        else:  # a dataset spec (file or name) or "synthetic"
            tree["data"] = {"source": data}
    for section in ("store", "pipeline"):  # irrelevant here, and may name paths of the training machine
        tree.pop(section, None)
    return config_from_dict(tree, overrides)


class _Data:
    """What to score: ``parts`` (split name, blocks of at most ``batch_size`` rows) in order, their rows
    (``total``, None when unknown), the files the blocks' origins number (``names``: relative to the
    data's folder; none for generated data), whether the rows have labels, and whether they are in
    another order than their files' (``memory``: a split held in memory, maybe sorted)."""

    def __init__(
        self,
        dataset: Dataset,
        parts: list[tuple[str, Iterator[Block]]],
        total: int | None,
        *,
        memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.parts = parts
        self.total = total
        self.memory = memory
        spec = getattr(dataset, "spec", None)
        self.labels = bool(getattr(getattr(spec, "read", None), "has_label", True))
        self.files: list[Path] = list(getattr(dataset, "origin_files", []))
        root = getattr(dataset, "root", None)
        self.names = [_relative(p, root) for p in self.files]


def _relative(path: Path, root: Path | None) -> str:
    if root is not None:
        with contextlib.suppress(ValueError):
            return path.relative_to(root).as_posix()
    return str(path)


def _dataset(parsed: Bundle, config: RunConfig, data: str | None, inputs: Sequence[Path]) -> Dataset:
    from recsys.data.source import build_dataset, data_root, spec_of
    from recsys.data.spec_dataset import input_dataset, scoring_dataset

    if inputs:
        spec = spec_of(config.data) if data is not None else _bundle_spec(parsed, config)
        if spec is None:
            raise UserError(
                "--input needs the dataset spec the model was trained with, and this bundle's data is "
                f"{config.data.source!r}: pass --data SPEC"
            )
        return input_dataset(spec, list(inputs), on_error=config.data.on_error)
    spec = spec_of(config.data)
    if spec is None or spec.format.value == "synthetic":
        return build_dataset(config.data, synthetic=config.synthetic, seed=config.train.seed)
    root = data_root(spec, config.data)
    return scoring_dataset(spec, root=root, seed=config.train.seed, on_error=config.data.on_error)


def _bundle_spec(parsed: Bundle, config: RunConfig) -> DatasetSpec | None:
    """The spec recorded in the bundle, else the one its training config names."""
    from recsys.data.source import spec_of
    from recsys.serving.raw import bundle_spec

    spec = bundle_spec(parsed.model, where=f"{parsed.path}/model.json")
    return spec if spec is not None else spec_of(config.data)


def _parts(dataset: Dataset, split: str, batch_size: int, limit: int | None, inputs: bool) -> _Data:
    """The blocks of the rows to score, split by split."""
    from recsys.data.row_sources import MemorySource, rebatch

    names = ["train"] if inputs else ["train", "eval"] if split == "all" else [split]
    sources = {"train": getattr(dataset, "train_source", None), "eval": getattr(dataset, "eval_source", None)}
    if all(sources[n] is not None for n in names):
        parts = [(n, rebatch(sources[n].blocks(), batch_size)) for n in names]  # type: ignore[union-attr]
        totals = [_rows_hint(sources[n]) for n in names]  # type: ignore[arg-type]
        total = None if None in totals else sum(t for t in totals if t is not None)
        memory = any(isinstance(sources[n], MemorySource) for n in names)
        return _Data(
            dataset, parts, total if limit is None or total is None else min(total, limit), memory=memory
        )
    sample_block = getattr(dataset, "sample_block", None)
    if sample_block is not None:  # synthetic data: generated blocks, no origin
        stats = dataset.split_stats()  # type: ignore[attr-defined]
        rows = {n: (None if stats[n].sampled else stats[n].rows) for n in names}
        if limit is None and any(r is None for r in rows.values()):
            raise UserError(
                "this dataset's training split has no end (synthetic data): pass --rows N to score its first N rows"
            )
        parts = [(n, _generated(sample_block, n, rows[n] or limit or 0, batch_size)) for n in names]
        total = sum(r or limit or 0 for r in rows.values())
        return _Data(dataset, parts, total if limit is None else min(total, limit))
    parts = [(n, _factory_blocks(dataset, n, batch_size, limit)) for n in names]
    return _Data(dataset, parts, limit)


def _rows_hint(source: RowSource) -> int | None:
    """The rows of a split when counting them costs no parse (for the progress bar), else None."""
    from recsys.data.issues import OnError
    from recsys.data.row_sources import MemorySource

    if isinstance(source, MemorySource) or getattr(source, "on_error", OnError.RAISE) is OnError.RAISE:
        return source.num_rows()
    return None


def _generated(sample_block: Any, split: str, rows: int, batch_size: int) -> Iterator[Block]:
    import numpy as np

    for start in range(0, rows, batch_size):
        index = np.arange(start, min(rows, start + batch_size), dtype=np.uint64)
        yield sample_block(index, split=split)


def _factory_blocks(dataset: Dataset, split: str, batch_size: int, limit: int | None) -> Iterator[Block]:
    """A factory's batches as blocks (its batches are TorchRec's: this path needs TorchRec)."""
    import numpy as np

    from recsys.data.block import Block, Jagged

    if split == "eval":
        batches = dataset.eval_batches(rank=0, world_size=1, batch_size=batch_size)
    elif limit is None:
        raise UserError(
            "a factory's training split has no known end: pass --rows N to score its first N rows"
        )
    else:
        batches = dataset.train_batches(rank=0, world_size=1, batch_size=batch_size, start_step=0)
    for batch in batches:
        jagged = batch.sparse.to_dict()
        ids = tuple(
            Jagged(jagged[n].values().numpy().astype(np.int64), jagged[n].lengths().numpy().astype(np.int64))
            for n in dataset.feature_names
        )
        yield Block(batch.dense.numpy(), ids, batch.labels.numpy())


def predict(
    bundle: Path,
    out: Path,
    *,
    data: str | None = None,
    split: str = "eval",
    inputs: Sequence[Path] = (),
    keep: Sequence[str] = (),
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score every row of a split, or of ``inputs``, and write the scores to ``out`` (``.csv``,
    ``.csv.gz``, ``.parquet``).

    ``data``: a run config or a dataset spec (path or name); None: the bundle's training config (with
    ``inputs``: the spec the bundle records, else the one its config names). ``inputs``: files to score
    whole with that spec's layout (no split). ``keep``: columns of the input files written beside each
    score. ``options``: ``batch_size`` (4096), ``cache_rows`` (65536 per tiered table), ``rows`` (score
    at most this many rows), ``overrides`` (``section.key=value``, as for train), ``verify`` (True:
    checksums).

    Returns ``{"rows", "out", "cache", "defaults"}`` (``cache``: per tiered feature its hit rate;
    ``defaults``: per bounded feature its ``lookups``, the ``defaults`` among them — ids without a row,
    scored with the table's default row — and their ``share``).

    Raises:
        UserError: a bad bundle, data whose features do not match the model, no rows to score, an
            unknown ``keep`` column, an unknown output suffix. On any failure no file is left behind.
    """
    opts = {
        "batch_size": 4096,
        "cache_rows": 1 << 16,
        "rows": None,
        "overrides": [],
        "verify": True,
        **(options or {}),
    }
    if split not in SPLITS:
        raise UserError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if opts["batch_size"] < 1:
        raise UserError(f"--batch-size must be >= 1, got {opts['batch_size']}")
    clash = [k for k in keep if k in _OWN_COLUMNS]
    if clash:
        raise UserError(f"--keep {','.join(clash)}: predict writes a column of that name itself")
    kind = out_kind(out)
    parsed = read_bundle(bundle, verify=opts["verify"])  # a bad bundle is refused before the heavy imports

    config = _config(parsed.model.get("config") or {}, data, list(opts["overrides"]))
    dataset = _dataset(parsed, config, data, inputs)
    from recsys.serving.scorer import Scorer

    scorer = Scorer(parsed, cache_rows=int(opts["cache_rows"]), device=_device(), unseen="init")
    try:
        if sorted(dataset.feature_names) != sorted(scorer.features) or dataset.num_dense != scorer.num_dense:
            raise UserError(
                f"the data has sparse features {dataset.feature_names} and {dataset.num_dense} dense ones; "
                f"the model was trained on {scorer.features} and {scorer.num_dense}"
            )
        keys = _keys(dataset, keep)
        source = _parts(dataset, split, opts["batch_size"], opts["rows"], bool(inputs))
        try:  # the scores' folder, made as export makes its bundle's
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(
                f"--out {out}: cannot make its folder {out.parent}: {err.strerror or err}"
            ) from None
        remove_stale(out)  # what a predict killed outright (SIGKILL) left beside it
        try:
            return _score(scorer, source, keys, out, kind, split if not inputs else "input", opts["rows"])
        except OSError as err:  # a full disk; the temporary file is gone already
            failure = write_failure(err, out, "predict again")
            if failure is None:
                raise
            raise failure from err
    finally:
        scorer.close()


def _keys(dataset: Dataset, keep: Sequence[str]) -> Any:
    """The reader of the ``keep`` columns (None without them)."""
    if not keep:
        return None
    from recsys.data.origins import OriginColumns

    spec = getattr(dataset, "spec", None)
    if spec is None or not hasattr(dataset, "origin_files"):
        raise UserError("--keep needs named columns; generated data (synthetic, a factory's) has none")
    return OriginColumns(spec, dataset.origin_files, dataset.columns(), list(keep))  # type: ignore[attr-defined]


def _score(
    scorer: Any, data: _Data, keys: Any, out: Path, kind: str, what: str, limit: int | None
) -> dict[str, Any]:
    from tqdm import tqdm

    columns = ["file", "line"] if data.names else ["row"]
    columns += (["split"] if what == "all" else []) + (keys.names if keys is not None else [])
    columns += (["label"] if data.labels else []) + ["logit", "score"]
    # Rows in another order than their files' (a sorted split): their key columns are read in one pass
    # at the end, so the scores are held until then.
    held: list[dict[str, Any]] | None = [] if keys is not None and data.memory else None
    done = 0
    writer: ScoreFile | None = None
    bar: Any = None
    try:
        writer = ScoreFile(out, kind, columns)
        for row in _scored(scorer, data, what, limit):
            if bar is None:  # from the first row on: a refusal stays one line
                bar = tqdm(total=data.total, unit="row", desc="predict", dynamic_ncols=True, mininterval=1.0)
            if held is not None:
                held.append(row)
            else:
                _write(writer, keys, row)
            done += len(row["score"])
            bar.update(len(row["score"]))
        if held:
            _write_held(writer, keys, held)
        if done == 0:
            raise UserError(_no_rows(what))
        writer.close(keep=True)
        writer = None
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close(keep=False)
    stats = scorer.cache_stats()
    cache = {f: {"hit_rate": s.hit_rate, "hits": s.hits, "misses": s.misses} for f, s in stats.items()}
    defaults = {
        f: {"share": d.share, "lookups": d.lookups, "defaults": d.defaults}
        for f, d in scorer.default_stats().items()
    }
    return {"rows": done, "out": str(out), "cache": cache, "defaults": defaults}


def _scored(scorer: Any, data: _Data, what: str, limit: int | None) -> Iterator[dict[str, Any]]:
    """The output columns of each block of rows, at most ``limit`` rows in all (the keys' come later)."""
    import numpy as np
    import torch

    from recsys.data.block import unpack_origin

    file_names = np.array(data.names, dtype=object)
    done = 0
    for name, blocks in data.parts:
        position = 0
        for whole in blocks:
            n = whole.num_rows if limit is None else min(whole.num_rows, limit - done)
            block = whole if n == whole.num_rows else whole.slice(0, n)
            logits = scorer.logits(block.dense, _sparse(block, data.dataset.feature_names)).numpy()
            row: dict[str, Any] = {
                "logit": logits,
                "score": torch.sigmoid(torch.from_numpy(logits)).numpy(),  # as scorer(...) returns
            }
            if data.names:
                if block.origin is None:
                    raise UserError("the data's reader gave no line numbers")  # a reader's bug
                file, line = unpack_origin(block.origin)
                row |= {"file": file_names[file], "line": line, "origin": block.origin}
            else:
                row["row"] = np.arange(position, position + n, dtype=np.int64)
            if what == "all":
                row["split"] = np.full(n, name, dtype=object)
            if data.labels:
                row["label"] = block.labels.astype(np.float32)
            yield row
            position += n
            done += n
            if limit is not None and done >= limit:
                return


def _write(writer: ScoreFile, keys: Any, row: dict[str, Any]) -> None:
    if keys is not None:
        row.update(zip(keys.names, keys.values(row["origin"]), strict=True))
    writer.write(row)


def _write_held(writer: ScoreFile, keys: Any, held: list[dict[str, Any]]) -> None:
    """Rows held back: their key columns read in one pass over the files, then written in order."""
    import numpy as np

    values = keys.values(np.concatenate([r["origin"] for r in held]))
    start = 0
    for row in held:
        n = len(row["score"])
        row.update({k: v[start : start + n] for k, v in zip(keys.names, values, strict=True)})
        writer.write(row)
        start += n


def _no_rows(what: str) -> str:
    if what == "input":
        return "no rows to score: the input files hold no data rows"
    if what == "all":
        return "no rows to score: the data has none"
    other = "--split train or --split all" if what == "eval" else "--split eval or --split all"
    return (
        f"no rows to score: the {what} split is empty (a spec's [split] eval_fraction = 0 holds out no "
        f"rows); pass {other}, or --input FILE to score files whole"
    )


def _sparse(block: Block, names: list[str]) -> dict[str, tuple[Any, Any]]:
    return {name: (j.values, j.lengths) for name, j in zip(names, block.ids, strict=True)}


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
