"""Checking a checkpoint before anything of it is loaded: its meta.json and every file it lists."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import torch.distributed as dist

from embedding_store.config import MAX_ID
from recsys.checkpoint import files as ckpt_files
from recsys.checkpoint.files import (
    _DIGEST,
    _RANK_FILE,
    _STORE_DIR,
    DAMAGED_PREFIX,
    FORMAT,
    META,
    CheckpointError,
    _complete,
    _digest,
    _lmdb_lock,
    _open_regular,
    _rank_world,
    _tree,
)

log = logging.getLogger("recsys")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """``repr`` of a value read from a file, cut to keep the message one short line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _outside(path: Path, name: str) -> str | None:
    """Why ``path/name`` is not confined to checkpoint ``path`` (symlinks resolved), or None."""
    try:
        resolved = (path / name).resolve()
        base = path.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop
        return f"cannot be resolved ({err})"
    return (
        None if resolved.is_relative_to(base) and resolved != base else f"resolves to {resolved}, outside it"
    )


def _entry_problem(path: Path, name: Any, entry: Any, world: int) -> str | None:
    """Why manifest entry ``name`` of a checkpoint of ``world`` ranks is unacceptable, or None.

    Only the name is looked at, and where it resolves: nothing is opened.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        return f"manifest entry {_short(name)} is not a file name"
    pure = PurePosixPath(name)
    if pure.is_absolute():
        return f"manifest entry {_short(name)} is an absolute path"
    if ".." in pure.parts:
        return f"manifest entry {_short(name)} contains '..'"
    if str(pure) != name or name == ".":
        return f"manifest entry {_short(name)} is not a normalised relative path"
    for pattern, part, form in (
        (_RANK_FILE, name, "rank_{}.pt"),
        (_STORE_DIR, pure.parts[0], "store_rank_{}"),
    ):
        if (m := pattern.fullmatch(part)) and part != form.format(int(m[1])):
            return f"manifest entry {_short(name)} is not a rank's name (that would be {form.format(int(m[1]))!r})"
        if m and int(m[1]) >= world:
            return f"manifest entry {_short(name)} is of rank {int(m[1])}, but world_size is {world}"
    if (why := _outside(path, name)) is not None:
        return f"manifest entry {_short(name)} {why}"
    if not (
        isinstance(entry, dict)
        and _is_int(entry.get("bytes"))
        and entry["bytes"] >= 0
        and isinstance(entry.get("blake2b"), str)
        and _DIGEST.fullmatch(entry["blake2b"])
    ):
        return f"bad manifest entry for {_short(name)}: {_short(entry)}"
    return None


def _meta_problem(path: Path, meta: Any) -> str | None:
    """Why a parsed ``meta.json`` of checkpoint ``path`` is unacceptable, or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    fmt, step, world, files = (meta.get(k) for k in ("format", "step", "world_size", "files"))
    if not _is_int(fmt) or fmt != FORMAT:
        return f"format {_short(fmt)} is not {FORMAT}, the format this version reads"
    if not _is_int(step) or step < 0:
        return f"step must be an integer >= 0, got {_short(step)}"
    if path.name != f"step_{step:08d}":
        return f"step {step} does not match the directory name {path.name}"
    if not _is_int(world) or world < 1:
        return f"world_size must be an integer >= 1, got {_short(world)}"
    if meta.get("fingerprint") is not None and not isinstance(meta["fingerprint"], dict):
        return f"fingerprint must be an object, got {_short(meta['fingerprint'])}"
    features = meta.get("features")
    if features is not None and (
        not isinstance(features, list)
        or not features
        or not all(isinstance(f, str) and f for f in features)
        or len(set(features)) != len(features)
    ):
        return f"features must be a list of distinct feature names, got {_short(features)}"
    store_tables = meta.get("store_tables")
    if store_tables is not None and (
        not isinstance(store_tables, list) or not all(isinstance(t, str) and t for t in store_tables)
    ):
        return f"store_tables must be a list of table names, got {_short(store_tables)}"
    digest = meta.get("digest")
    if digest is not None and not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        return f"digest must be 32 hexadecimal digits, got {_short(digest)}"
    bounds = meta.get("bounds")
    if bounds is not None and not (
        isinstance(bounds, dict)
        and all(isinstance(k, str) and k and type(v) is int and 0 < v <= MAX_ID for k, v in bounds.items())
    ):
        return f"bounds must map table names to default row ids in [1, 2**63), got {_short(bounds)}"
    if meta.get("spec") is not None and not isinstance(meta["spec"], dict):
        return f"spec must be an object, got {_short(meta['spec'])}"
    if not isinstance(files, dict):
        return f"the manifest (files) must be an object, got {type(files).__name__}"
    ranks = set()
    for name, entry in files.items():
        if (why := _entry_problem(path, name, entry, world)) is not None:
            return why
        if m := _RANK_FILE.fullmatch(name):
            ranks.add(int(m[1]))
    if len(ranks) != world:  # every listed rank is below world: one of the first len(ranks) + 1 is missing
        missing = next(r for r in range(world) if r not in ranks)
        return f"world_size is {world} but the manifest lists no rank_{missing}.pt"
    return None


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """The validated ``meta.json`` of complete checkpoint ``path``.

    Checks what it says, not the files it lists (that is :func:`verify_checkpoint`): ``format`` is
    ``FORMAT``; ``step`` an integer >= 0 that matches the directory name; ``world_size`` an integer >= 1;
    the manifest lists exactly ``rank_0.pt`` .. ``rank_{W-1}.pt``, store folders of ranks below W, and names
    that are relative, normalised, without ``..`` and resolve (symlinks included) inside ``path``; each
    entry has its size and checksum. Nothing outside ``path`` is opened.

    Returns:
        ``{"format", "step", "world_size", "files", "fingerprint", "trainer", "features", "spec"}``;
        ``fingerprint``, ``trainer``, ``features`` (the model's interaction order of its sparse
        features) and ``spec`` (the dataset spec, :func:`recsys.data.spec.spec_to_dict`) are None when
        the checkpoint was saved without them (``spec``: or the data had none); so are
        ``store_tables`` (the tables whose rows are in the store snapshots, the others are in memory) and
        ``digest`` (the model digest, with ``train.checkpoint_digest``) and ``bounds`` (each bounded
        table's default row id).

    Raises:
        CheckpointError: one line naming the problem and the offending value.
    """
    try:
        if (why := _outside(path, META)) is not None:
            raise ValueError(why)
        with _open_regular(path / META) as f:
            meta = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({err})") from None
    if (problem := _meta_problem(path, meta)) is not None:
        raise CheckpointError(f"{path / META}: {problem}")
    keys = ("format", "step", "world_size", "files", "fingerprint", "trainer", "features", "spec")
    keys += ("store_tables", "digest", "bounds")
    return {key: meta.get(key) for key in keys}


def _check_file(path: Path, name: str, entry: dict[str, Any]) -> str | None:
    """Why ``path/name`` does not match its (validated) manifest entry, or None when it does."""
    file = path / name
    try:
        with _open_regular(file) as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry["bytes"]:
                return f"{file} is truncated or altered ({size} bytes, the manifest says {entry['bytes']})"
            if _digest(f) != entry["blake2b"]:
                return f"{file} is altered (checksum mismatch)"
    except FileNotFoundError:
        return f"{file} is missing"
    except (OSError, ValueError) as err:
        return f"{file} is unreadable ({err})"
    return None


def verify_checkpoint(path: Path) -> list[str]:
    """Problems of a complete checkpoint: a ``meta.json`` that :func:`checkpoint_meta` refuses, files
    missing, truncated or altered against the manifest, or files it does not list (anything but
    ``meta.json``, temporary names left by a killed writer, and the ``lock.mdb`` an LMDB tool leaves beside
    a store snapshot's ``data.mdb``, which nothing reads).

    Collective when a process group is initialised: rank r checks every r-th file and every rank gets
    the problems of all of them.
    """
    rank, world = _rank_world()
    problems: list[str] = []
    try:
        files = checkpoint_meta(path)["files"]
    except CheckpointError as err:
        problems = [str(err)]
    else:
        if rank == 0:
            unlisted = sorted(
                n for n in _tree(path) if n not in files and n != META and not _lmdb_lock(path, n, files)
            )
            problems += [f"{path / name} is not listed in the manifest" for name in unlisted]
        for i, (name, entry) in enumerate(sorted(files.items())):
            if i % world == rank and (why := _check_file(path, name, entry)) is not None:
                problems.append(why)
    if world > 1:
        parts: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(parts, problems)
        problems = sorted(set(sum(parts, [])))
    return problems


def resumable_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint that passes :func:`verify_checkpoint`, or None if there is none.

    A damaged checkpoint is reported (a warning naming the bad file), renamed ``damaged_step_...`` by
    rank 0 so that it is neither resumed from nor counted as one of the kept checkpoints, and the next
    older one is tried. Collective when a process group is initialised.
    """
    rank, world = _rank_world()
    for path in reversed(_complete(root)):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        if rank == 0:
            log.warning(
                "checkpoint %s is damaged: %s; moved to %s%s, trying the previous complete checkpoint",
                path,
                problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                DAMAGED_PREFIX,
                path.name,
            )
            target = path.with_name(DAMAGED_PREFIX + path.name)
            if target.exists():
                shutil.rmtree(target)
            path.rename(target)
            ckpt_files._fsync_dir(root)
        if world > 1:
            dist.barrier()
    return None


# What a rank file must hold (``shard_offsets`` is checked where it is needed: older files lack it).


def checkpoint_world_size(path: Path) -> int:
    """The number of ranks that wrote checkpoint ``path`` (from :func:`checkpoint_meta`)."""
    return int(checkpoint_meta(path)["world_size"])
