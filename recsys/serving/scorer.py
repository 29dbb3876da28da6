"""Score raw features with an exported model: :func:`load_bundle` and :class:`Scorer`.

Needs torch, numpy, lmdb and safetensors only (no TorchRec, FBGEMM or torch.distributed), and runs on
the CPU or a CUDA device. Plain tables are held in memory on the device; tiered tables are read through
a host-DRAM LRU cache (:class:`recsys.serving.cache.RowCache`) over the bundle's LMDB, so tables larger
than RAM are served. An id of a bounded table without a row of its own reads the table's default row
(:mod:`recsys.serving.bounded`). Sum pooling, then the dense model of :mod:`recsys.serving.model`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from embedding_store.init import init_rows
from recsys.errors import UserError
from recsys.serving.bounded import BoundedPlain, DefaultStats
from recsys.serving.bundle import DENSE, TABLES, TIERED, Bundle, BundleError, FeatureSpec, read_bundle
from recsys.serving.cache import CacheStats, LmdbRows, RowCache, open_rows
from recsys.serving.model import build_dense_model
from recsys.serving.raw import RawFields, bundle_spec

__all__ = ["Scorer", "load_bundle", "UNSEEN"]

# What a tiered id never stored in training gets: its deterministic initial row, as training would
# create it, or zeros. (A bounded table's id without a row gets its default row, whatever this says.)
UNSEEN = ("init", "zeros")

SparseInput = Any  # Mapping[str, ids (B,) | (values (N,), lengths (B,))], or a KeyedJaggedTensor


def _as_ids(value: Any, where: str) -> np.ndarray:
    arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{where} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where} must be integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _jagged(sparse: SparseInput, names: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per feature ``(values (N,), lengths (B,))`` from any accepted form of the sparse input."""
    if hasattr(sparse, "length_per_key") and hasattr(sparse, "keys"):  # a KeyedJaggedTensor
        keys = list(sparse.keys())
        values = torch.split(sparse.values(), sparse.length_per_key())
        lengths = sparse.lengths().reshape(len(keys), -1)
        sparse = {k: (v, lengths[i]) for i, (k, v) in enumerate(zip(keys, values, strict=True))}
    if not isinstance(sparse, Mapping):
        raise ValueError(
            f"sparse features must be a mapping of feature name to ids, got {type(sparse).__name__}"
        )
    missing = [n for n in names if n not in sparse]
    unknown = sorted(str(k) for k in sparse if k not in names)
    if missing or unknown:
        raise ValueError(
            f"sparse features: missing {missing}, unknown {unknown}; the model's features are {names}"
        )
    out = {}
    for name in names:
        value = sparse[name]
        if isinstance(value, tuple | list) and len(value) == 2 and not np.isscalar(value[0]):
            ids, lengths = (
                _as_ids(value[0], f"feature {name!r} values"),
                _as_ids(value[1], f"feature {name!r} lengths"),
            )
            if (lengths.size and lengths.min() < 0) or int(lengths.sum()) != ids.shape[0]:
                raise ValueError(
                    f"feature {name!r}: lengths sum to {int(lengths.sum())}, not its {ids.shape[0]} values"
                )
        else:
            ids = _as_ids(value, f"feature {name!r}")
            lengths = np.ones(ids.shape[0], dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise ValueError(f"feature {name!r}: id {int(ids.min())} is negative")
        out[name] = (ids, lengths)
    return out


def _load_tensors(bundle: Bundle, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file of the bundle; a malformed one is a :class:`BundleError` (its
    manifest entry may match: an altered bundle re-hashed, or one read without checksums)."""
    try:
        return load_file(bundle.file(name))
    except (SafetensorError, OSError) as err:
        raise BundleError(
            f"bundle {bundle.path}: {name} is not a readable safetensors file ({err})"
        ) from None


class Scorer:
    """Click probabilities of raw feature batches under an exported model (thread-safe).

    Build it with :func:`load_bundle`. ``scorer(dense, sparse)`` returns ``(B,)`` float32 probabilities,
    :meth:`logits` the logits; both on the CPU.

    ``dense``: ``(B, num_dense)`` numbers. ``sparse``: for every feature of :attr:`features`, either
    ``(B,)`` ids (one per sample), or ``(values (N,), lengths (B,))`` (``lengths[i]`` ids of sample i,
    sum-pooled; 0 gives a zero vector), or a KeyedJaggedTensor with those keys. Ids are the raw ids the
    training data had: plain tables fold them modulo their rows as training did. An id of a bounded table
    that has no row of its own reads the table's default row; :meth:`default_stats` counts those lookups.
    """

    def __init__(
        self, bundle: Bundle, *, cache_rows: int | Mapping[str, int], device: torch.device, unseen: str
    ) -> None:
        if unseen not in UNSEEN:
            raise ValueError(f"unseen must be one of {UNSEEN}, got {unseen!r}")
        self.bundle = bundle
        self.device = device
        self.features = [f.name for f in bundle.features]
        self._specs = {f.name: f for f in bundle.features}
        self._dim = bundle.features[0].dim  # the pooled (B, F, dim) tensor: every table has one dim
        self.num_dense = bundle.num_dense
        self._seed, self._scale = bundle.init
        self._unseen = unseen
        try:
            self._spec = bundle_spec(bundle.model, f"bundle {bundle.path}: model.json")
        except UserError as err:
            raise BundleError(str(err)) from None
        self._raw: RawFields | None = None
        dense = _load_tensors(bundle, DENSE)
        try:
            model = build_dense_model(
                bundle.arch, dense, num_dense=self.num_dense, num_sparse=len(self.features)
            )
        except ValueError as err:
            raise BundleError(f"bundle {bundle.path}: {err}") from None
        self._model = model.to(device)
        tables = _load_tensors(bundle, TABLES)
        # fp16 tables stay fp16 in memory; the rows a lookup gathers are upcast, as FBGEMM sums them in float32
        self._weight_dtype = getattr(torch, bundle.weights_precision.dtype)
        self._plain: dict[str, torch.Tensor] = {}
        self._bounded: dict[str, BoundedPlain] = {}
        for f in bundle.features:
            if f.kind == "plain":
                weight = tables.get(f"{f.table}.weight")
                if weight is None or tuple(weight.shape) != (f.rows, f.dim):
                    shape = None if weight is None else tuple(weight.shape)
                    raise BundleError(
                        f"bundle {bundle.path}: table {f.table} is {shape} in {TABLES}, model.json says {(f.rows, f.dim)}"
                    )
                if weight.dtype != self._weight_dtype:
                    raise BundleError(
                        f"bundle {bundle.path}: table {f.table} is {weight.dtype} in {TABLES}, "
                        f"not {self._weight_dtype} (the bundle's weights_precision)"
                    )
                self._plain[f.name] = weight.to(device)
                if f.default_id is not None:
                    ids = tables.get(f"{f.table}.ids")
                    where = f"bundle {bundle.path}: bounded table {f.table} in {TABLES}"
                    if ids is None or tuple(ids.shape) != (f.rows,):
                        shape = None if ids is None else tuple(ids.shape)
                        raise BundleError(f"{where}: its ids are {shape}, model.json says {(f.rows,)}")
                    self._bounded[f.name] = BoundedPlain(ids, f.default_id, where)
        tiered = [f for f in bundle.features if f.kind == "tiered"]
        self._rows: LmdbRows | None = None
        self._caches: dict[str, RowCache] = {}
        if tiered:
            self._rows = open_rows(
                bundle.file(TIERED).parent,
                tables=[f.table for f in tiered],
                row_floats=bundle.row_floats,
                weights_precision=bundle.weights_precision,
            )
            for f in tiered:  # a damaged or foreign LMDB is refused here, not at the first lookup
                self._rows.check(f.table, f.rows)
            for f in tiered:
                rows = cache_rows.get(f.name, 0) if isinstance(cache_rows, Mapping) else cache_rows
                self._caches[f.name] = RowCache(self._rows, f, capacity=int(rows), fill=self._filler(f))

    def _filler(self, f: FeatureSpec) -> Any:
        if f.default_id is not None:  # a bounded table: every id without a row reads the default row
            assert self._rows is not None
            found, row = self._rows.read(f.table, np.array([f.default_id], dtype=np.int64), f.dim)
            if not found[0]:
                raise BundleError(
                    f"bundle {self.bundle.path}: bounded table {f.table} lacks its default row {f.default_id} in {TIERED}"
                )
            return lambda ids: np.repeat(row, ids.shape[0], axis=0)
        if self._unseen == "zeros":
            return lambda ids: np.zeros((ids.shape[0], f.dim), dtype=np.float32)
        dtype = self._weight_dtype  # initial rows are rounded once to the tables' precision, as in training
        return lambda ids: (
            init_rows(ids, dim=f.dim, seed=self._seed, table=f.table, scale=self._scale)
            .to(dtype)
            .float()
            .numpy()
        )

    # -- scoring ----------------------------------------------------------------------------------

    def _pool(self, f: FeatureSpec, ids: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """Sum-pooled (B, dim) embeddings of one feature."""
        if f.kind == "plain":
            bounded = self._bounded.get(f.name)
            if bounded is not None:
                index = torch.from_numpy(bounded.positions(ids)).to(self.device)
            else:
                index = torch.from_numpy(ids % f.rows if f.rows else ids).to(self.device)
            weight = self._plain[f.name]
            if weight.dtype != torch.float32:  # the gathered rows, upcast; then summed as float32 rows are
                weight, index = torch.nn.functional.embedding(index, weight).float(), None
        else:
            if f.id_space is not None and ids.size and ids.max() >= f.id_space:
                raise ValueError(
                    f"feature {f.name!r}: id {int(ids.max())} is outside its id space [0, {f.id_space})"
                )
            weight = self._caches[f.name].lookup(ids).to(self.device)  # a row per value
            index = None
        if ids.shape[0] == lengths.shape[0] and (lengths == 1).all():
            # One id per sample: its row is the sum (the gather alone, without the bags' offsets).
            return weight if index is None else torch.nn.functional.embedding(index, weight)
        if index is None:
            index = torch.arange(ids.shape[0], device=self.device)
        offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64))
        return torch.nn.functional.embedding_bag(index, weight, offsets.to(self.device), mode="sum")

    @torch.no_grad()
    def logits(self, dense: Any, sparse: SparseInput) -> torch.Tensor:
        """``(B,)`` float32 logits on the CPU."""
        x = torch.as_tensor(
            np.asarray(dense, dtype=np.float32) if not isinstance(dense, torch.Tensor) else dense
        )
        x = x.to(device=self.device, dtype=torch.float32)
        if x.ndim != 2 or x.shape[1] != self.num_dense:
            raise ValueError(f"dense features must be (batch, {self.num_dense}), got shape {tuple(x.shape)}")
        jagged = _jagged(sparse, self.features)
        if x.shape[0] == 0:
            return torch.empty(0, dtype=torch.float32)
        for name, (_, lengths) in jagged.items():
            if lengths.shape[0] != x.shape[0]:
                raise ValueError(
                    f"feature {name!r} has {lengths.shape[0]} samples, the dense features {x.shape[0]}"
                )
        pooled = torch.empty(x.shape[0], len(self.features), self._dim, device=self.device)
        for i, name in enumerate(self.features):
            pooled[:, i] = self._pool(self._specs[name], *jagged[name])
        return self._model(x, pooled).float().cpu()

    def __call__(self, dense: Any, sparse: SparseInput) -> torch.Tensor:
        """``(B,)`` float32 click probabilities on the CPU."""
        return torch.sigmoid(self.logits(dense, sparse))

    # -- raw records -------------------------------------------------------------------------------

    def _fields(self) -> RawFields:
        if self._raw is None:
            if self._spec is None:
                raise ValueError(
                    "this model was trained on data without a dataset spec (synthetic data or a factory): "
                    "score ids and dense values with scorer(dense, sparse)"
                )
            self._raw = RawFields(self._spec, self.features)
        return self._raw

    @property
    def dense_names(self) -> list[str] | None:
        """The dense features by name, in the order of the dense input (None without a dataset spec)."""
        return None if self._spec is None else self._fields().dense_names

    def encode(self, records: Any) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """The model inputs of raw records (:class:`recsys.serving.raw.RawFields`): ``(dense, sparse)``."""
        return self._fields().encode(records)

    def score(self, records: Any) -> torch.Tensor:
        """``(N,)`` float32 click probabilities of raw records: mappings of column name to the value as
        it appears in the training data (text or a number; None or ``""`` for an empty field), parsed and
        transformed by the dataset spec the model was trained with.

        Raises:
            ValueError: a record lacks a column the model needs or holds a value the spec refuses (the
                message names the record's index, the field and the value).
        """
        return self(*self.encode(records))

    def cache_stats(self) -> dict[str, CacheStats]:
        """Per tiered feature, its cache's counters (hit rate, rows read from LMDB, unseen ids)."""
        return {name: cache.stats() for name, cache in self._caches.items()}

    def default_stats(self) -> dict[str, DefaultStats]:
        """Per bounded feature, its lookups and those that read the default row (ids without a row)."""
        out = {name: b.stats() for name, b in self._bounded.items()}
        for f in self.bundle.features:
            if f.kind == "tiered" and f.default_id is not None and f.name in self._caches:
                s = self._caches[f.name].stats()
                out[f.name] = DefaultStats(s.hits + s.misses, s.filled)
        return {name: out[name] for name in self.features if name in out}

    def close(self) -> None:
        """Drop this scorer's tables and caches (the bundle's LMDB closes with its last scorer)."""
        self._caches.clear()
        self._plain.clear()
        self._bounded.clear()
        self._rows = None


def load_bundle(
    path: str | os.PathLike[str],
    *,
    cache_rows: int | Mapping[str, int] = 1 << 16,
    device: str | torch.device = "cpu",
    unseen: str = "init",
    verify: bool = True,
) -> Scorer:
    """Open a bundle written by ``recsys export`` and return its :class:`Scorer`.

    Args:
        path: the bundle directory.
        cache_rows: host-DRAM rows cached per tiered table (or per feature, a mapping; 0: none).
        device: where the dense model and the plain tables compute (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        unseen: rows of tiered ids never stored in training: ``"init"`` (their deterministic initial
            value, exactly as training would create them) or ``"zeros"``. A bounded table's ids
            without a row read its default row either way, as training's evaluation does.
        verify: check every file's checksum (off: presence and sizes only; a checksum reads every byte).

    Raises:
        BundleError: an incomplete or altered bundle, or one of another format version (one line).

    Example:
        >>> scorer = load_bundle("runs/quickstart/bundle", cache_rows=100_000)
        >>> probs = scorer(np.zeros((2, scorer.num_dense)), {f: np.array([3, 7]) for f in scorer.features})
        >>> probs.shape
        torch.Size([2])
        >>> scorer.cache_stats()["cat_0"].hit_rate
        0.0
    """
    bundle = read_bundle(path, verify=verify)
    return Scorer(bundle, cache_rows=cache_rows, device=torch.device(device), unseen=unseen)
