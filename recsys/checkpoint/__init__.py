"""Checkpoints: every rank's dense parameters, optimizer state, embedding shards, data position and RNG.

Layout: ``DIR/checkpoints/step_00000100/{rank_0.pt, rank_1.pt, ..., store_rank_r/, meta.json}``. Each rank
writes its files atomically (temporary name, fsync, rename, fsync of the folder); rank 0 writes ``meta.json``
only after every rank has finished, so a checkpoint without it is incomplete and never resumed from.
``meta.json`` is also the manifest: the size and BLAKE2b checksum of every file of the checkpoint.
:func:`resumable_checkpoint` verifies the newest complete checkpoint against it and falls back to an older
one, saying why, when a file is missing, truncated, altered or not listed, or ``meta.json`` itself does not
hold up (see :func:`checkpoint_meta`). Files load with ``torch.load(weights_only=True)``: no pickled code.

Modules: ``manager`` (the :class:`Checkpointable` protocol and :func:`save_checkpoint`), ``state`` (the
model's part, :class:`ModelState`, and re-partitioning onto another number of ranks), ``verify`` (what a
checkpoint must hold up to before it is loaded), ``files`` (names, checksums, pruning),
``fingerprint`` (the settings a resumed run may not change) and ``parts`` (the trainer's other parts:
the store snapshot, the run's record, the digest and the config; the run's progress is
:class:`recsys.train_state.TrainState`).
"""

from recsys.checkpoint.files import DAMAGED_PREFIX, META, CheckpointError, _describe, latest_checkpoint
from recsys.checkpoint.fingerprint import (
    check_resume_settings,
    fingerprint_mismatch,
    fixed_setting_change,
    model_fingerprint,
)
from recsys.checkpoint.manager import Checkpoint, Checkpointable, save_checkpoint
from recsys.checkpoint.state import ModelState, load_checkpoint
from recsys.checkpoint.verify import (
    _short,
    checkpoint_meta,
    checkpoint_world_size,
    resumable_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "DAMAGED_PREFIX",
    "META",
    "Checkpoint",
    "CheckpointError",
    "Checkpointable",
    "ModelState",
    "_describe",
    "_short",
    "check_resume_settings",
    "checkpoint_meta",
    "checkpoint_world_size",
    "fingerprint_mismatch",
    "fixed_setting_change",
    "latest_checkpoint",
    "load_checkpoint",
    "model_fingerprint",
    "resumable_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
