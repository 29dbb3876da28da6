"""The checkpoint parts of a trainer besides the model's (:class:`~recsys.checkpoint.ModelState`) and the
run's progress (:class:`~recsys.train_state.TrainState`): the tiered store's snapshot, what serving and a
resume need to know of the run (``meta.json``), the model digest and the resolved config.

Each is given what it saves, never the trainer: a part writes only its own files and ``meta.json``
entries (:class:`~recsys.checkpoint.Checkpointable`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save

from recsys.bounded import BoundedTables
from recsys.build import ModelParts
from recsys.checkpoint.files import write_file_durably
from recsys.checkpoint.fingerprint import model_fingerprint
from recsys.checkpoint.manager import Checkpoint
from recsys.config import RunConfig, config_to_dict
from recsys.data.spec import spec_to_dict
from recsys.metrics import to_json
from recsys.models import interaction_order
from recsys.tiered import TieredTables

__all__ = ["BoundsState", "ConfigRecord", "DigestRecord", "RunRecord", "StoreState"]

log = logging.getLogger("recsys")


class StoreState:
    """The checkpoint part of the tiered store: this rank's snapshot, ``store_rank_<r>/``."""

    def __init__(self, tables: TieredTables) -> None:
        self.tables = tables

    def save(self, into: Checkpoint) -> list[Path]:
        return self.tables.snapshot(into.path / f"store_rank_{into.rank}")

    def restore(self, source: Checkpoint) -> None:
        if source.meta["world_size"] == source.world_size:
            self.tables.open(snapshot=source.path / f"store_rank_{source.rank}")
        else:  # rows re-partitioned by this run's ownership
            self.tables.open(reshard_from=sorted(source.path.glob("store_rank_*")))


class BoundsState:
    """The checkpoint part of bounded tables: this rank's admission, expiry and cap state,
    ``bounds_rank_<r>.safetensors`` (arrays ``<table>/<key>``).

    A resume on another number of ranks re-partitions the per-id state by the new ownership, so admission
    and expiry continue exactly; a row cap (``max_rows``) ranks each owner's rows against each other, so
    after a re-partition it removes other rows than the old run would have: the run says so once.

    Args:
        bounded: this rank's bounds (:class:`~recsys.bounded.BoundedTables`).
        owns: ``owns(table, ids)`` -> (n,) bool, which ids this rank owns now.
    """

    def __init__(self, bounded: BoundedTables, owns: Callable[[str, np.ndarray], np.ndarray]) -> None:
        self.bounded = bounded
        self.owns = owns

    def save(self, into: Checkpoint) -> list[Path]:
        path = into.path / f"bounds_rank_{into.rank}.safetensors"
        state = self.bounded.state(trained=into.step)  # with the steps a pipeline decided ahead
        # Serialized in memory, then written like every checkpoint file: a full disk is an OSError (ENOSPC),
        # and never leaves a partial file under the final name.
        data = save({k: np.ascontiguousarray(v) for k, v in state.items()})
        return [write_file_durably(path, lambda f: f.write(data))]

    def restore(self, source: Checkpoint) -> None:
        files = sorted(source.path.glob("bounds_rank_*.safetensors"))
        if not files:  # a checkpoint of a run without bounds: the fingerprint check refused it already
            return
        if source.meta["world_size"] == source.world_size:
            self.bounded.restore(
                [load_file(str(source.path / f"bounds_rank_{source.rank}.safetensors"))], self.owns
            )
            return
        capped = sorted(n for n, r in self.bounded.rules.items() if r.max_rows)
        if capped and source.rank == 0:
            log.warning(
                "resuming on %d ranks a run of %d: the row cap (store.bounds max_rows) of %s is per owner rank, "
                "so from here the model differs from a resume on %d ranks; admission and expiry continue exactly",
                source.world_size,
                source.meta["world_size"],
                ", ".join(capped),
                source.meta["world_size"],
            )
        self.bounded.restore([load_file(str(f)) for f in files], self.owns, totals=source.rank == 0)


class RunRecord:
    """The checkpoint part that says what was trained, in ``meta.json``: the settings that change the model
    (``fingerprint``, checked on resume), the model's order of its sparse features and the dataset spec
    (for serving), the tables whose rows are in the store snapshots (``store_tables``) and, for a run
    with bounded tables, each one's default row id (``bounds``: ``{table: default_id}``; absent without
    bounds, so other runs' ``meta.json`` is unchanged).

    Args:
        config: the run's config.
        parts: the model's parts (the sharded model, its table configs, the data, the tier binding).
    """

    def __init__(self, config: RunConfig, parts: ModelParts) -> None:
        self.config = config
        self.parts = parts

    def save(self, into: Checkpoint) -> list[Path]:
        p = self.parts
        into.meta["fingerprint"] = model_fingerprint(self.config)
        # The order of the sparse features in the model's interaction: serving stacks them so.
        into.meta["features"] = interaction_order(p.dmp, p.tables)
        # The dataset spec's field transforms, which serving applies to raw records (recsys export).
        spec = getattr(p.data, "spec", None)
        into.meta["spec"] = None if spec is None else spec_to_dict(spec)
        # Which tables' rows are in the store snapshots (the others are in the rank files): a resume
        # does not move rows between the two (Trainer.restore refuses a change).
        into.meta["store_tables"] = list(p.binding.store_tables)
        # Bounded tables and their default rows: recsys export keeps only the rows the bounds say exist
        # and scores every other id with the default row, as evaluation does (recsys.bounded).
        bounded = p.binding.bounded
        if bounded is not None:
            into.meta["bounds"] = {name: int(d) for name, d in sorted(bounded.default_ids.items())}
        return []

    def restore(self, source: Checkpoint) -> None:
        """Nothing: the trainer checks the fingerprint and the store tables before any part restores."""


class DigestRecord:
    """The checkpoint part that records the model digest (``train.checkpoint_digest``), in ``meta.json``;
    the trainer checks the restored model against it. Saved after the store: the digest of tiered tables
    is read from the snapshot just written.

    Args:
        digest: ``digest(checkpoint)``: the model digest with tiered rows read from the checkpoint's
            snapshot (collective).
        enabled: ``train.checkpoint_digest``.
    """

    def __init__(self, digest: Callable[[Path], str], *, enabled: bool) -> None:
        self.digest = digest
        self.enabled = enabled

    def save(self, into: Checkpoint) -> list[Path]:
        if self.enabled:
            into.meta["digest"] = self.digest(into.path)  # collective
        return []

    def restore(self, source: Checkpoint) -> None:
        """Nothing: the check needs every part restored (Trainer.restore)."""


class ConfigRecord:
    """The checkpoint part that records the resolved config (rank 0), for ``recsys evaluate``/``export``."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def save(self, into: Checkpoint) -> list[Path]:
        if into.rank != 0:
            return []
        text = (to_json(config_to_dict(self.config), indent=2, sort_keys=False) + "\n").encode()
        return [write_file_durably(into.path / "config.json", lambda f: f.write(text))]

    def restore(self, source: Checkpoint) -> None:
        """Nothing: the run's own config is the one that applies (the fingerprint is checked first)."""
