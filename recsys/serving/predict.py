"""``recsys predict``: stream a dataset through a bundle's scorer and write one score per input row.

The data is the held-out split (``--split eval``, default), the training split (``train``) or both
(``all``, training rows first) of the bundle's own training config, of another config, or of a dataset
spec. Rows are read and scored batch by batch and written as they come, so memory stays bounded by a
batch (and, for Parquet, one row group). Each output row holds the row's position in its split, its
label when the data has one, the logit and the click probability (``score``).
"""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from recsys.config import RunConfig, config_from_dict
from recsys.data.batch import Batch
from recsys.data.epochs import eval_batches_of
from recsys.data.source import Dataset, build_dataset
from recsys.errors import UserError
from recsys.serving.bundle import read_bundle
from recsys.serving.scorer import Scorer

__all__ = ["predict", "SPLITS"]

SPLITS = ("eval", "train", "all")
_PARQUET_GROUP_ROWS = 1 << 16


def _config(bundle_config: dict[str, Any], data: str | None, overrides: list[str]) -> RunConfig:
    """The run config whose data to score: the bundle's, another config file's, or a spec in its place."""
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


def _has_labels(dataset: Dataset) -> bool:
    spec = getattr(dataset, "spec", None)
    return bool(getattr(getattr(spec, "read", None), "has_label", True))


def _batches(dataset: Dataset, split: str, batch_size: int, limit: int | None) -> Iterator[tuple[str, Batch]]:
    """``(split, batch)`` in order; each split read once, in file (or generation) order."""
    if split in ("train", "all"):
        yield from (("train", b) for b in _train_batches(dataset, batch_size, limit))
    if split in ("eval", "all"):
        yield from (("eval", b) for b in dataset.eval_batches(rank=0, world_size=1, batch_size=batch_size))


def _train_batches(dataset: Dataset, batch_size: int, limit: int | None) -> Iterator[Batch]:
    source = getattr(dataset, "train_source", None)
    if source is not None:  # one pass over the spec's training rows, in file order
        yield from eval_batches_of(source, dataset.feature_names, rank=0, world_size=1, batch_size=batch_size)
        return
    stats = dataset.split_stats()["train"] if hasattr(dataset, "split_stats") else None
    rows = limit if limit is not None else (None if stats is None or stats.sampled else stats.rows)
    if rows is None:
        raise UserError(
            "this dataset's training split has no end (synthetic data): pass --rows N to score its first N rows"
        )
    batches = dataset.train_batches(rank=0, world_size=1, batch_size=batch_size, start_step=0)
    for done in range(0, rows, batch_size):
        yield next(batches)
        if done + batch_size >= rows:
            return


def _total_rows(dataset: Dataset, split: str, limit: int | None) -> int | None:
    try:
        stats = dataset.split_stats()  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError):
        return limit
    names = ["train", "eval"] if split == "all" else [split]
    if any(stats[n].sampled for n in names):
        return limit
    total = sum(stats[n].rows for n in names)
    return total if limit is None else min(total, limit)


class _Writer:
    """Rows out to CSV or Parquet (by the file's suffix), appended batch by batch."""

    def __init__(self, path: Path, *, labels: bool, splits: bool) -> None:
        name = path.name.lower()
        self.kind = (
            "parquet"
            if name.endswith((".parquet", ".pq"))
            else "csv"
            if name.endswith((".csv", ".csv.gz"))
            else ""
        )
        if not self.kind:
            raise UserError(f"--out {path}: the suffix must be .csv, .csv.gz, .parquet or .pq")
        self.labels, self.splits = labels, splits
        self.path = path
        self._tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_rows = 0
        if self.kind == "parquet":
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError:
                raise UserError(
                    "Parquet output needs pyarrow: pip install 'tierrec[parquet]' (or write .csv)"
                ) from None
            fields = [("row", pa.int64())] + ([("split", pa.string())] if splits else [])
            fields += ([("label", pa.float32())] if labels else []) + [
                ("logit", pa.float32()),
                ("score", pa.float32()),
            ]
            self._pa, self._schema = pa, pa.schema(fields)
            self._parquet = pq.ParquetWriter(self._tmp, self._schema)
        else:
            import gzip

            # Open for the writer's lifetime; close() ends it (on success and on failure alike).
            opener = gzip.open if name.endswith(".gz") else open
            self._csv = opener(self._tmp, "wt")  # noqa: SIM115
            header = (
                ["row"] + (["split"] if splits else []) + (["label"] if labels else []) + ["logit", "score"]
            )
            self._csv.write(",".join(header) + "\n")

    def write(self, columns: dict[str, np.ndarray]) -> None:
        if self.kind == "csv":
            rows = [columns["row"].astype(str)]
            if self.splits:
                rows.append(columns["split"])
            if self.labels:
                rows.append(np.char.mod("%g", columns["label"]))
            rows += [np.char.mod("%.9g", columns["logit"]), np.char.mod("%.9g", columns["score"])]
            self._csv.write("".join(",".join(r) + "\n" for r in zip(*rows, strict=True)))
            return
        self._pending.append(columns)
        self._pending_rows += columns["row"].shape[0]
        if self._pending_rows >= _PARQUET_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        data = {f.name: np.concatenate([p[f.name] for p in self._pending]) for f in self._schema}
        self._parquet.write_table(self._pa.table(data, schema=self._schema))
        self._pending, self._pending_rows = [], 0

    def close(self, *, keep: bool) -> None:
        if self.kind == "parquet":
            if keep:
                self._flush()
            self._parquet.close()
        else:
            self._csv.close()
        if keep:
            os.replace(self._tmp, self.path)
        else:
            self._tmp.unlink(missing_ok=True)


def predict(
    bundle: Path,
    out: Path,
    *,
    data: str | None = None,
    split: str = "eval",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score every row of a split and write the scores to ``out`` (``.csv``, ``.csv.gz``, ``.parquet``).

    ``data``: a run config or a dataset spec (path or name); None: the bundle's training config.
    ``options``: ``batch_size`` (4096), ``cache_rows`` (65536 per tiered table), ``rows`` (score at most
    this many rows), ``overrides`` (``section.key=value``, as for train), ``verify`` (True: checksums).

    Returns ``{"rows", "out", "cache"}`` (``cache``: per tiered feature its hit rate).

    Raises:
        UserError: a bad bundle, data whose features do not match the model, an unknown output suffix.
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
    limit = opts["rows"]
    parsed = read_bundle(bundle, verify=opts["verify"])
    config = _config(parsed.model.get("config") or {}, data, list(opts["overrides"]))
    dataset = build_dataset(config.data, synthetic=config.synthetic, seed=config.train.seed)
    scorer = Scorer(parsed, cache_rows=int(opts["cache_rows"]), device=_device(), unseen="init")
    if sorted(dataset.feature_names) != sorted(scorer.features) or dataset.num_dense != scorer.num_dense:
        raise UserError(
            f"the data has sparse features {dataset.feature_names} and {dataset.num_dense} dense ones; "
            f"the model was trained on {scorer.features} and {scorer.num_dense}"
        )
    labels = _has_labels(dataset)
    writer = _Writer(out, labels=labels, splits=split == "all")
    total = _total_rows(dataset, split, limit)
    written = {"train": 0, "eval": 0}
    done = 0
    keep = False
    try:
        with tqdm(total=total, unit="row", desc="predict", dynamic_ncols=True, mininterval=1.0) as bar:
            for name, batch in _batches(dataset, split, opts["batch_size"], limit):
                n = batch.batch_size if limit is None else min(batch.batch_size, limit - done)
                logits = scorer.logits(batch.dense[:n], _head(batch, n)).numpy()
                columns = {
                    "row": np.arange(written[name], written[name] + n, dtype=np.int64),
                    "logit": logits,
                    "score": torch.sigmoid(torch.from_numpy(logits)).numpy(),  # as scorer(...) returns
                }
                if split == "all":
                    columns["split"] = np.full(n, name, dtype=object)
                if labels:
                    columns["label"] = batch.labels[:n].numpy().astype(np.float32)
                writer.write(columns)
                written[name] += n
                done += n
                bar.update(n)
                if limit is not None and done >= limit:
                    break
        keep = True
        stats = scorer.cache_stats()
    finally:
        writer.close(keep=keep)
        scorer.close()
    cache = {f: {"hit_rate": s.hit_rate, "hits": s.hits, "misses": s.misses} for f, s in stats.items()}
    return {"rows": done, "out": str(out), "cache": cache}


def _head(batch: Batch, n: int) -> Any:
    """The sparse features of the batch's first ``n`` samples."""
    if n == batch.batch_size:
        return batch.sparse
    kjt = batch.sparse
    out = {}
    for key, jt in kjt.to_dict().items():
        lengths = jt.lengths()[:n]
        out[key] = (jt.values()[: int(lengths.sum())], lengths)
    return out


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
