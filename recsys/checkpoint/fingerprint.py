"""Which settings change the trained model: a resumed run is refused when they differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recsys.config import RunConfig, config_to_dict
from recsys.errors import UserError

# Per section of RunConfig, the keys that do not change the trained model; sections not named here
# (store, pipeline, eval) change none. Every other key does, including keys added later.
_NOT_MODEL: dict[str, frozenset[str]] = {
    "train": frozenset(
        {"steps", "nproc", "log_every", "checkpoint_every", "final_checkpoint", "keep_checkpoints"}
        | {"threads_per_rank", "checkpoint_digest"}
        | {"collective_timeout_s"}
    ),
    "model": frozenset(),
    "sparse": frozenset(),
    "data": frozenset({"path", "cache_dir", "on_error"}),
    "synthetic": frozenset({"eval_samples"}),
}


def model_fingerprint(config: RunConfig) -> dict[str, Any]:
    """The settings of ``config`` that change the trained model, as flat ``{"section.key": value}``.

    The rule: a key is in when resuming under another value would silently train another model than the
    one the checkpoint continues. In: every key of ``[model]`` and ``[sparse]``; ``train.seed``,
    ``train.batch_size`` (global), ``train.dense_optimizer`` and ``train.dense_learning_rate``;
    ``data.source``; ``store.bounds``; and, when it is ``synthetic``, every key of ``[synthetic]`` but
    ``eval_samples``.
    Out: ``train.steps`` (a run may be extended on resume), ``train.nproc`` (resuming on another number of
    ranks re-partitions), the logging, checkpointing, threading and timeout keys; where the data lives
    (``data.path``, ``data.cache_dir``) and ``data.on_error`` (switching to ``skip`` after a run stopped at
    a bad line trains on the same rows so far); the rest of ``[store]`` and ``[pipeline]`` (where rows live and how
    batches are fed: tiered tables train the same model as in-memory tables that hold every id, and
    ``pipeline.frozen_windows`` changes rounding only) and ``[eval]`` (evaluation never updates the
    model). Keys added to a section later are in unless listed in ``_NOT_MODEL``. Values are JSON-safe:
    enums as their values, tuples as lists.
    """
    tree = config_to_dict(config)
    out: dict[str, Any] = {}
    for section, excluded in _NOT_MODEL.items():
        if section == "synthetic" and config.data.source != "synthetic":
            continue  # the dataset spec, not this section, describes the data
        out |= {f"{section}.{key}": v for key, v in tree[section].items() if key not in excluded}
    out["store.bounds"] = tree["store"]["bounds"]  # admission, expiry and the cap decide which rows exist
    return out


def fingerprint_mismatch(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """One ``"key: saved X, now Y"`` line per key whose value differs (values as JSON; a key only one
    side has shows ``(none)`` on the other). A checkpoint saved without a fingerprint (None) matches, and
    so does a key the checkpoint predates (absent from ``saved``) that now holds its default value: the
    setting did not exist, and its default trains what the code that saved the checkpoint trained."""
    if saved is None:
        return []

    def shown(side: dict[str, Any], key: str) -> str:
        return json.dumps(side[key], sort_keys=True) if key in side else "(none)"

    now = json.loads(json.dumps(current))  # compared as stored: tuples as lists
    defaults = _defaults()
    return [
        f"{key}: saved {shown(saved, key)}, now {shown(now, key)}"
        for key in sorted(saved.keys() | now.keys())
        if shown(saved, key) != shown(now, key)
        and not (key not in saved and key in defaults and shown(defaults, key) == shown(now, key))
    ]


def _defaults() -> dict[str, Any]:
    """Every setting's default value, flat (``"section.key"``), as JSON values."""
    from recsys.config import config_from_dict

    tree = json.loads(json.dumps(config_to_dict(config_from_dict({}))))
    return {f"{section}.{key}": v for section, keys in tree.items() for key, v in keys.items()}


# Settings that no resume may change, not even with --allow-config-change, and why: what the checkpoint holds
# was made for the saved value, and nothing converts it.
_FIXED_ON_RESUME: dict[str, str] = {
    "train.seed": "the embedding rows' initial values depend on it",
    "store.bounds": (
        "the checkpoint holds the rows, admission counts and default rows of the saved bounds, and a capped "
        "table's shape; nothing converts them to other bounds"
    ),
    "sparse.weights_precision": (
        "the checkpoint's rows and the store's rows are kept at the saved precision; nothing converts them"
    ),
}


def fixed_setting_change(path: object, saved: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """One line refusing a resume of checkpoint ``path`` that changes a setting no resume may change (the
    seed, ``store.bounds``, ``sparse.weights_precision``), or None. Checked before any worker starts
    (:func:`recsys.checkpoint.check_resume_settings`) and again by each rank (under torchrun there is no
    launcher)."""
    if saved is None:
        return None
    changed = {line.partition(":")[0] for line in fingerprint_mismatch(saved, current)}
    for key, why in _FIXED_ON_RESUME.items():
        if key in changed:
            was = json.dumps(saved.get(key, _defaults().get(key)), sort_keys=True)
            now = json.dumps(json.loads(json.dumps(current.get(key))), sort_keys=True)
            what = "the seed" if key == "train.seed" else key
            return (
                f"--resume: {path} was trained with {key}={was}, this run has {key}={now}; {what} cannot change "
                f"on resume, not even with --allow-config-change ({why}): restore it, or train a new run "
                "in another --out"
            )
    return None


def check_resume_settings(root: Path, config: RunConfig) -> None:
    """Refuse, before any worker starts, a resume from the newest complete checkpoint under ``root`` that
    would change a setting no resume may change (:func:`fixed_setting_change`).

    Raises:
        UserError: the one line naming the setting, both values and the fix.
    """
    from recsys.checkpoint.files import _complete
    from recsys.checkpoint.verify import checkpoint_meta

    complete = _complete(root)
    if not complete:
        return
    try:
        meta = checkpoint_meta(complete[-1])
    except (UserError, OSError, ValueError):
        return  # a damaged checkpoint: the ranks' resume reports it and falls back to an older one
    message = fixed_setting_change(complete[-1], meta.get("fingerprint"), model_fingerprint(config))
    if message is not None:
        raise UserError(message)
