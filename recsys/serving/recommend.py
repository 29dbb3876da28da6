"""``recsys recommend``: the top K candidates of every user under a bundle's model.

Two files, each with a header line and the delimiter of the bundle's dataset spec: the users (one row
per user: the user-side columns the spec reads) and the candidates (one row per item: the item-side
columns). Every ``[[dense]]`` and ``[[sparse]]`` field of the spec is read from exactly one of them. A
(user, candidate) pair is the record made of both rows, and it scores as that record's line in a file
given to ``recsys predict --input`` would: each side is turned into model inputs once, by the spec's
own field code (:meth:`recsys.serving.scorer.Scorer.encode`, over records that pair it with the other
side's first row; a field reads its own column only), and the pairs of a user are scored in batches of
its candidates through the bundle's scorer.

Per user the output holds its ``K`` best candidates, one line per rank: ``user``, ``rank`` (1 = best),
``item``, ``logit`` and ``score``. Equal scores rank by item key (as integers when every key is one, else
as text). The user and item keys are the values of ``--user-column`` / ``--item-column`` (default: each
file's first column).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import numpy as np

from recsys.errors import UserError
from recsys.serving.bundle import read_bundle
from recsys.serving.output import remove_stale
from recsys.serving.score_file import ScoreFile, out_kind

__all__ = ["recommend", "top_k"]

COLUMNS = ["user", "rank", "item", "logit", "score"]


def _read(path: Path, delimiter: str, what: str) -> tuple[list[str], list[dict[str, str]]]:
    """A delimited file's header and rows (as text)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = next(reader, None)
            if not header:
                raise UserError(f"--{what} {path}: empty file (it needs a header line)")
            rows = []
            for line, values in enumerate(reader, start=2):
                if len(values) != len(header):
                    raise UserError(
                        f"--{what} {path}:{line}: {len(values)} fields, the header has {len(header)}"
                    )
                rows.append(dict(zip(header, values, strict=True)))
    except OSError as err:
        raise UserError(f"--{what} {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise UserError(f"--{what} {path}: not UTF-8 text") from None
    if not rows:
        raise UserError(f"--{what} {path}: no rows after the header")
    return header, rows


def _sort_keys(keys: list[str]) -> np.ndarray:
    """Each key's place in key order: as integers when every key is one, else as text."""
    try:
        as_int = np.array([int(k) for k in keys], dtype=object)
    except ValueError:
        as_int = None
    values = as_int if as_int is not None else np.array(keys, dtype=object)
    order = sorted(range(len(keys)), key=values.__getitem__)
    place = np.empty(len(keys), dtype=np.int64)
    place[order] = np.arange(len(keys))
    return place


def top_k(logits: np.ndarray, item_place: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` highest ``logits``, best first; equal logits in ``item_place`` order.
    (Equal features need not give equal logits: the model's matrix products round by a row's place in
    its batch.)"""
    return np.lexsort((item_place, -logits.astype(np.float64)))[:k]


def recommend(
    bundle: Path,
    users: Path,
    candidates: Path,
    out: Path,
    *,
    k: int,
    user_column: str | None = None,
    item_column: str | None = None,
    batch_size: int = 4096,
    cache_rows: int = 1 << 16,
) -> dict[str, Any]:
    """Write the top ``k`` candidates of every user to ``out`` (.csv, .csv.gz, .parquet).

    Returns ``{"users", "candidates", "pairs", "seconds", "pairs_per_s", "out"}``.

    Raises:
        UserError: a bundle without a dataset spec, a file that cannot be read, a field in neither file
            or in both, an unknown key column, or ``k`` / ``batch_size`` below 1 (one line each).
    """
    if k < 1:
        raise UserError(f"--k must be >= 1, got {k}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    kind = out_kind(out)
    parsed = read_bundle(bundle)
    import torch

    from recsys.serving.raw import bundle_spec
    from recsys.serving.scorer import Scorer

    spec = bundle_spec(parsed.model, where=f"{parsed.path}/model.json")
    if spec is None:
        raise UserError(
            "recommend reads raw records with the dataset spec the model was trained on, and this bundle's "
            "data had none (synthetic data or a factory)"
        )
    delimiter = spec.read.delimiter
    user_header, user_rows = _read(users, delimiter, "users")
    item_header, item_rows = _read(candidates, delimiter, "candidates")
    user_key = user_column or user_header[0]
    item_key = item_column or item_header[0]
    for column, header, what in ((user_key, user_header, "users"), (item_key, item_header, "candidates")):
        if column not in header:
            raise UserError(f"--{what}: no key column {column!r} (columns: {', '.join(header)})")
    fields = [(d.column or d.name, "dense", d.name) for d in spec.dense]
    fields += [(s.column or s.name, "sparse", s.name) for s in spec.sparse]
    user_side: set[str] = set()  # feature names read from the users file
    for column, _, name in fields:
        in_users, in_items = column in user_header, column in item_header
        if in_users == in_items:
            where = "both files" if in_users else "neither file"
            raise UserError(
                f"field {name!r} (column {column!r}) is in {where}: each field comes from the users file "
                "or the candidates file"
            )
        if in_users:
            user_side.add(name)

    scorer = Scorer(parsed, cache_rows=cache_rows, device=torch.device("cpu"), unseen="init")
    try:
        try:  # each side's inputs, paired with the other side's first row
            u_dense, u_sparse = scorer.encode([{**item_rows[0], **row} for row in user_rows])
            c_dense, c_sparse = scorer.encode([{**row, **user_rows[0]} for row in item_rows])
        except ValueError as err:
            raise UserError(f"recommend: {err}") from None
        dense_names = scorer.dense_names or []
        user_dense = np.array([n in user_side for n in dense_names], dtype=bool)
        from recsys.data.block import Jagged

        u_jagged = {f: Jagged(*ids) for f, ids in u_sparse.items() if f in user_side}
        c_jagged = {f: Jagged(*ids) for f, ids in c_sparse.items() if f not in user_side}
        item_place = _sort_keys([row[item_key] for row in item_rows])
        item_keys = np.array([row[item_key] for row in item_rows], dtype=object)
        num_items, top = len(item_rows), min(k, len(item_rows))
        remove_stale(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = ScoreFile(out, kind, COLUMNS)
        started = time.perf_counter()
        from tqdm import tqdm

        try:
            bar = tqdm(
                total=len(user_rows), unit="user", desc="recommend", dynamic_ncols=True, mininterval=1.0
            )
            for u, row in enumerate(user_rows):
                logits = np.empty(num_items, dtype=np.float32)
                for start in range(0, num_items, batch_size):
                    items = np.arange(start, min(num_items, start + batch_size))
                    rows = np.full(items.shape[0], u)
                    dense = np.where(user_dense, u_dense[rows], c_dense[items]).astype(np.float32)
                    sparse = {
                        f: (u_jagged[f].take(rows) if f in user_side else c_jagged[f].take(items))
                        for f in scorer.features
                    }
                    logits[items] = scorer.logits(
                        dense, {f: (j.values, j.lengths) for f, j in sparse.items()}
                    )
                # best first; equal logits by item key
                best = top_k(logits, item_place, top)
                scores = torch.sigmoid(torch.from_numpy(logits)).numpy()  # as predict's, over the batch
                writer.write(
                    {
                        "user": np.full(top, row[user_key], dtype=object),
                        "rank": np.arange(1, top + 1),
                        "item": item_keys[best],
                        "logit": logits[best],
                        "score": scores[best],
                    }
                )
                bar.update(1)
            bar.close()
            writer.close(keep=True)
        except BaseException:
            writer.close(keep=False)
            raise
    finally:
        scorer.close()
    seconds = time.perf_counter() - started
    pairs = len(user_rows) * num_items
    return {
        "users": len(user_rows),
        "candidates": num_items,
        "pairs": pairs,
        "seconds": seconds,
        "pairs_per_s": pairs / seconds if seconds > 0 else float("nan"),
        "out": str(out),
    }
