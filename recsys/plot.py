"""``recsys plot --run DIR [--out FILE.png]``: one picture of a run's curves, read from its files.

Panels: the training loss per log window; the held-out log loss and AUC of every evaluation beside the
constant predictor (log loss: ``constant_logloss`` of the evaluation records, the training split's
positive rate predicted for every row; AUC: 0.5, what any constant score gets), with the best held-out
log loss marked on every panel; and, for a tiered run, the device and host hit rates of all tiered tables
per log window, beside each table's rates over the training batches from ``summary.json``.

It reads JSON only (``metrics.jsonl``, and ``summary.json`` when there is one): no torch, no TorchRec, so
it answers in well under a second. :func:`read_records` and :func:`curves` are pure and raise
:class:`~recsys.errors.UserError` for what cannot be read; :func:`plot_run` writes the PNG (matplotlib, the
``plots`` extra). A non-finite value (a NaN loss, an undefined AUC: ``null`` in strict JSON, ``NaN`` in
files of older versions) is left out of its line and marked with a red x at the bottom of its panel.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys.errors import UserError

__all__ = ["PLOTS_HINT", "Curves", "curves", "plot_run", "read_records", "table_rates"]

PLOTS_HINT = "plots need matplotlib: pip install 'tierrec[plots]' (or pip install matplotlib)"
NAN = math.nan


@dataclass
class Curves:
    """The series of one run, ordered by step; a non-finite or missing value is NaN.

    ``best_step`` is the evaluation with the lowest finite held-out log loss (the earliest of equal
    ones: ``eval.select = "logloss"`` keeps the same one), None without one; ``best_auc_step`` likewise
    for the highest AUC. ``tiers`` maps ``device_hit_rate`` and ``host_hit_rate`` to their values at
    ``tier_steps`` (all tiered tables, per log window); empty for an untiered run.
    """

    train_steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    auc: list[float] = field(default_factory=list)
    logloss: list[float] = field(default_factory=list)
    constant_logloss: float | None = None
    best_step: int | None = None
    best_logloss: float | None = None
    best_auc_step: int | None = None
    tier_steps: list[int] = field(default_factory=list)
    tiers: dict[str, list[float]] = field(default_factory=dict)
    gauc: list[float] = field(default_factory=list)  # with eval.group_by: at eval_steps
    bounds_steps: list[int] = field(default_factory=list)  # bounded tables: per log window
    bounds_rows: list[float] = field(default_factory=list)  # rows held, every bounded table
    default_share: list[float] = field(default_factory=list)  # lookups that read a default row
    epoch_steps: list[int] = field(default_factory=list)  # where an epoch of the training split ends

    def not_finite(self) -> dict[str, list[int]]:
        """{series: the steps where it is not finite}, for the series that have any."""
        series = {
            "training loss": (self.train_steps, self.loss),
            "held-out log loss": (self.eval_steps, self.logloss),
            "held-out AUC": (self.eval_steps, self.auc),
            **{name.replace("_", " "): (self.tier_steps, v) for name, v in self.tiers.items()},
        }
        out = {
            name: [s for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
            for name, (steps, values) in series.items()
        }
        return {name: steps for name, steps in out.items() if steps}


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The JSON objects of ``metrics.jsonl`` with their line numbers (key ``_line``), and whether an
    unfinished last line (no newline: a run still writing, or killed mid-write) was left out.

    Raises:
        UserError: the file is missing, unreadable, empty, or a complete line is not a JSON object.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path} not found (a run directory of recsys train has one)") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    lines = data.split(b"\n")
    torn = bool(lines.pop())  # b"" after the final newline; else the part of a line not yet written
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # also UnicodeDecodeError
            record = None
        if not isinstance(record, dict):
            raise UserError(f"{path} line {number} is not a JSON object: {_excerpt(line)}")
        records.append({**record, "_line": number})
    if not records:
        raise UserError(f"{path} has no records yet" + (" (only an unfinished line)" if torn else ""))
    return records, torn


def _excerpt(line: bytes) -> str:
    text = line.decode("utf-8", "replace").strip()
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _number(record: Mapping[str, Any], key: str, where: str) -> float:
    """``record[key]`` as a float: NaN when missing, null or not finite; a UserError when not a number."""
    value = record.get(key)
    if value is None:
        return NAN
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where}: {key} is {value!r}, not a number")
    return float(value)


def _step(record: Mapping[str, Any], where: str) -> int:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UserError(f"{where}: step is {step!r}, not a whole number >= 0")
    return step


def curves(records: Iterable[Mapping[str, Any]], *, source: str = "metrics.jsonl") -> Curves:
    """The run's series from its ``metrics.jsonl`` records (``kind`` ``train`` and ``eval``; other kinds
    are ignored). A later record of the same kind and step replaces an earlier one.

    Raises:
        UserError: a record's step or a value is of the wrong type, or no record is of either kind.
    """
    train: dict[int, Mapping[str, Any]] = {}
    evals: dict[int, Mapping[str, Any]] = {}
    for i, record in enumerate(records, 1):
        where = f"{source} line {record.get('_line', i)}"
        kind = record.get("kind")
        if kind in ("train", "eval"):
            (train if kind == "train" else evals)[_step(record, where)] = {**record, "_where": where}
    if not train and not evals:
        raise UserError(f"{source} has no training or evaluation records (kind 'train' or 'eval')")
    c = Curves()
    for step in sorted(train):
        r = train[step]
        c.train_steps.append(step)
        c.loss.append(_number(r, "loss", r["_where"]))
        bounds = r.get("bounds")
        if isinstance(bounds, dict) and isinstance(bounds.get("tables"), dict):
            c.bounds_steps.append(step)
            tables = bounds["tables"].values()
            c.bounds_rows.append(float(sum(_number(t, "rows", r["_where"] + " bounds") for t in tables)))
            c.default_share.append(_number(bounds, "default_share", r["_where"] + " bounds"))
        tiers = r.get("tiers")
        if tiers is None:
            continue
        if not isinstance(tiers, dict):
            raise UserError(f"{r['_where']}: tiers is {tiers!r}, not an object")
        c.tier_steps.append(step)
        for key in ("device_hit_rate", "host_hit_rate"):
            c.tiers.setdefault(key, []).append(_number(tiers, key, r["_where"] + " tiers"))
    for step in sorted(evals):
        r = evals[step]
        c.eval_steps.append(step)
        c.logloss.append(_number(r, "logloss", r["_where"]))
        c.auc.append(_number(r, "auc", r["_where"]))
        if "gauc" in r:
            c.gauc.append(_number(r, "gauc", r["_where"]))
        constant = _number(r, "constant_logloss", r["_where"])
        if math.isfinite(constant):
            c.constant_logloss = constant  # the same at every evaluation; the last one known
    for step, value in zip(c.eval_steps, c.logloss, strict=True):
        if math.isfinite(value) and (c.best_logloss is None or value < c.best_logloss):
            c.best_step, c.best_logloss = step, value
    best_auc = -math.inf
    for step, value in zip(c.eval_steps, c.auc, strict=True):
        if math.isfinite(value) and value > best_auc:
            c.best_auc_step, best_auc = step, value
    return c


def table_rates(summary: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """{tiered table: {device_hit_rate, host_hit_rate}} over the training batches, from a ``summary.json``
    document; tables or values it does not have (an untiered or unfinished run) are left out."""
    tiers = summary.get("tiers")
    out: dict[str, dict[str, float]] = {}
    if not isinstance(tiers, dict):
        return out
    for table, t in sorted(tiers.items(), key=lambda item: _natural(str(item[0]))):
        if not isinstance(t, dict):
            continue
        rates = {
            k: float(t[k])
            for k in ("device_hit_rate", "host_hit_rate")
            if isinstance(t.get(k), int | float) and not isinstance(t.get(k), bool)
        }
        if rates:
            out[str(table)] = rates
    return out


def _natural(name: str) -> list[Any]:
    """Sort key of a table name with its numbers as numbers: t_cat_2 before t_cat_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _summary(run: Path) -> dict[str, Any]:
    """``summary.json`` of a finished run, or {} (none yet, or not readable: it only adds detail)."""
    try:
        doc = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def load_run(run: Path) -> tuple[Curves, dict[str, Any], bool]:
    """The curves of run directory ``run``, its summary ({} without one) and whether an unfinished last
    line of ``metrics.jsonl`` was left out.

    Raises:
        UserError: no such directory, or its ``metrics.jsonl`` is missing, empty or damaged.
    """
    if not run.exists():
        raise UserError(f"run directory {run} does not exist")
    if not run.is_dir():
        raise UserError(f"--run {run} is not a directory")
    path = run / "metrics.jsonl"
    if not path.exists() and not (run / "summary.json").exists():
        seeds = sorted(p.name for p in run.glob("seed_*") if (p / "metrics.jsonl").exists())
        if seeds:
            raise UserError(
                f"{run} holds the runs of recsys train --seeds ({', '.join(seeds)}): plot one, "
                f"e.g. recsys plot --run {run / seeds[0]}"
            )
        raise UserError(f"{run} has no metrics.jsonl: not a run directory of recsys train")
    records, torn = read_records(path)
    c, summary = curves(records, source=str(path)), _summary(run)
    c.epoch_steps = epoch_steps(summary, max([*c.train_steps, *c.eval_steps]))
    return c, summary, torn


def epoch_steps(summary: Mapping[str, Any], last: int) -> list[int]:
    """The steps at which an epoch of the training split ends, up to ``last``: its rows over the global
    batch (``summary.json``'s ``splits.train.rows`` and ``config.train.batch_size``); none when either is
    unknown, or the split has no end (synthetic data: ``sampled``)."""
    try:
        train = summary["splits"]["train"]
        rows, sampled = train["rows"], train.get("sampled", False)
        batch = summary["config"]["train"]["batch_size"]
    except (KeyError, TypeError, AttributeError):
        return []
    if sampled or not isinstance(rows, int) or not isinstance(batch, int) or rows < batch or batch < 1:
        return []
    per_epoch = rows / batch
    return [round(per_epoch * e) for e in range(1, int(last / per_epoch) + 1)][:200]


def plot_run(run: Path, out: Path | None = None) -> tuple[Path, Curves, bool]:
    """Write the PNG of run directory ``run`` to ``out`` (default ``run/curves.png``); returns the path,
    the curves and whether an unfinished last line of ``metrics.jsonl`` was left out.

    Raises:
        UserError: bad input (see :func:`load_run`), ``out`` not a writable ``.png`` path, or no matplotlib.
    """
    out = run / "curves.png" if out is None else out
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: the picture is a PNG; give a file name ending in .png")
    c, summary, torn = load_run(run)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(PLOTS_HINT) from None
    fig = _draw(plt, c, table_rates(summary), title=_title(run, c, summary))
    try:
        fig.savefig(out, dpi=100)
    except OSError as err:
        raise UserError(f"cannot write {out}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return out, c, torn


def _title(run: Path, c: Curves, summary: Mapping[str, Any]) -> str:
    steps = summary.get("steps")
    last = max([*c.train_steps, *c.eval_steps])
    head = f"{run.resolve().name}: {steps if isinstance(steps, int) else last} steps"
    if c.best_step is None:
        return head + (
            "; no held-out evaluation yet" if not c.eval_steps else "; no finite held-out log loss"
        )
    line = f"{head}; best held-out log loss {c.best_logloss:.4f} at step {c.best_step} of {c.eval_steps[-1]}"
    if c.constant_logloss is not None:
        line += f" (constant predictor {c.constant_logloss:.4f})"
    return line


def describe(c: Curves) -> list[str]:
    """The lines ``recsys plot`` prints about the curves: the best evaluation and the non-finite points."""
    lines = []
    if c.best_step is not None:
        line = f"best held-out log loss {c.best_logloss:.4f} at step {c.best_step} of {c.eval_steps[-1]}"
        if c.constant_logloss is not None:
            line += f" (constant predictor {c.constant_logloss:.4f})"
        if c.best_step != c.eval_steps[-1]:
            line += f"; {len([s for s in c.eval_steps if s > c.best_step])} later evaluation(s) are worse"
        lines.append(line)
    elif c.eval_steps:
        lines.append("no evaluation has a finite held-out log loss")
    else:
        lines.append("no held-out evaluation in metrics.jsonl yet")
    for name, steps in c.not_finite().items():
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        lines.append(f"note: {name} is not finite at {len(steps)} step(s) ({shown}); marked with x")
    return lines


# -- the figure ------------------------------------------------------------------------------------------

BEST = {"color": "tab:green", "ls": "--", "lw": 1.2}


def _draw(plt: Any, c: Curves, tables: Mapping[str, Mapping[str, float]], *, title: str) -> Any:
    tiered = bool(c.tier_steps or tables)
    bounded = bool(c.bounds_steps)
    fig = plt.figure(figsize=(16, 9.6 if tiered or bounded else 5.0))
    grid = fig.add_gridspec(2 if tiered or bounded else 1, 3)
    loss = fig.add_subplot(grid[0, 0])
    logloss = fig.add_subplot(grid[0, 1], sharex=loss)
    auc = fig.add_subplot(grid[0, 2], sharex=loss)
    _series(loss, c.train_steps, c.loss, "training loss (mean per log window)", "tab:blue")
    finite = [(x, v) for x, v in zip(c.eval_steps, c.logloss, strict=True) if math.isfinite(v)]
    if finite:  # the same quantity on held-out rows: a widening gap is overfitting
        loss.plot(*zip(*finite, strict=True), "--", color="tab:orange", alpha=0.6, label="held-out log loss")
    _panel(
        loss,
        "Training loss (held-out log loss dashed)",
        "log loss",
        empty=not c.train_steps,
        note="no training log point yet",
    )
    _series(logloss, c.eval_steps, c.logloss, "held-out log loss", "tab:orange", marker="o")
    if c.constant_logloss is not None:
        logloss.axhline(
            c.constant_logloss, color="grey", ls=":", lw=1.5,
            label=f"constant predictor ({c.constant_logloss:.4f})",
        )  # fmt: skip
    if c.best_step is not None and c.best_logloss is not None:
        logloss.plot([c.best_step], [c.best_logloss], "*", color="tab:green", ms=16, zorder=5)
    _panel(logloss, "Held-out log loss (lower is better)", "log loss", empty=not c.eval_steps)
    _series(auc, c.eval_steps, c.auc, "held-out AUC", "tab:purple", marker="o")
    if c.gauc and len(c.gauc) == len(c.eval_steps):  # eval.group_by: the per-group AUC beside it
        _series(auc, c.eval_steps, c.gauc, "held-out GAUC (per group)", "tab:brown", marker="s")
    auc.axhline(0.5, color="grey", ls=":", lw=1.5, label="constant predictor (0.5)")
    if c.best_auc_step is not None:
        value = c.auc[c.eval_steps.index(c.best_auc_step)]
        auc.plot([c.best_auc_step], [value], "*", color="tab:purple", ms=14, zorder=5,
                 label=f"highest AUC: step {c.best_auc_step} ({value:.4f})")  # fmt: skip
    _panel(auc, "Held-out AUC (higher is better)", "AUC", empty=not c.eval_steps)
    shown = [v for v in (*c.auc, *c.gauc) if math.isfinite(v)]
    if shown:  # zoomed on the data: AUCs of one run often differ in the third digit
        pad = max(0.005, 0.15 * (max(shown) - min(shown)))
        auc.set_ylim(min(shown) - pad, max(shown) + pad)
    for ax in (loss, logloss, auc):
        if c.best_step is not None:
            ax.axvline(c.best_step, **BEST, label=f"best held-out log loss: step {c.best_step}")
        for i, step in enumerate(c.epoch_steps):
            ax.axvline(step, color="grey", lw=0.8, alpha=0.4, label="end of an epoch" if i == 0 else None)
        ax.legend(fontsize=8, loc="best")
    if tiered:
        _tiers(fig.add_subplot(grid[1, :2] if not bounded else grid[1, 0], sharex=loss), c)
        _tables(fig.add_subplot(grid[1, 2]), tables)
    if bounded:
        _bounds(fig.add_subplot(grid[1, 1] if tiered else grid[1, :], sharex=loss), c)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return fig


def _series(
    ax: Any, steps: list[int], values: list[float], label: str, color: str, *, marker: str = ""
) -> None:
    """The finite points as one line, and a red x at the bottom of the panel for each other one."""
    finite = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
    if finite:
        xs, ys = zip(*finite, strict=True)
        few = len(finite) <= 40
        ax.plot(xs, ys, "-", marker=marker or (".", "")[not few], color=color, label=label, ms=5)
    bad = [s for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
    if bad:
        ax.plot(bad, [0.03] * len(bad), "x", color="red", ms=8, mew=2, transform=ax.get_xaxis_transform(),
                clip_on=False, label=f"not finite: {len(bad)} point(s)")  # fmt: skip


def _panel(
    ax: Any, title: str, ylabel: str, *, empty: bool, note: str = "no held-out evaluation yet"
) -> None:
    ax.set_title(title)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if empty:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="grey")


def _tiers(ax: Any, c: Curves) -> None:
    for key, color in (("device_hit_rate", "tab:blue"), ("host_hit_rate", "tab:red")):
        tier = key.split("_")[0]
        _series(ax, c.tier_steps, c.tiers.get(key, []), f"{tier} hit rate", color)
    if c.best_step is not None:
        ax.axvline(c.best_step, **BEST, label=f"best held-out log loss: step {c.best_step}")
    _panel(ax, "Tier hit rates, all tiered tables, per log window", "hit rate", empty=not c.tier_steps,
           note="no tier rates in metrics.jsonl")  # fmt: skip
    low = min([0.0, *(v for vs in c.tiers.values() for v in vs if math.isfinite(v))])
    ax.set_ylim(low - 0.02, 1.02)
    ax.legend(fontsize=8, loc="lower right")


def _bounds(ax: Any, c: Curves) -> None:
    """Bounded tables: the rows they hold (left axis) and the share of lookups that read a default row
    (right axis), per log window."""
    _series(ax, c.bounds_steps, c.bounds_rows, "rows held (bounded tables)", "tab:olive")
    _panel(ax, "Bounded tables: rows held, default-row share", "rows", empty=False)
    share = ax.twinx()
    _series(share, c.bounds_steps, c.default_share, "default-row share", "tab:cyan")
    share.set_ylabel("share of lookups")
    share.set_ylim(0.0, 1.0)
    lines = ax.get_legend_handles_labels()
    more = share.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="best")


def _tables(ax: Any, tables: Mapping[str, Mapping[str, float]]) -> None:
    names = list(tables)
    ax.set_title("Hit rates per table over training: device (blue), host (red)", fontsize=11)
    ax.set_xlabel("hit rate")
    ax.grid(alpha=0.3, axis="x")
    if not names:
        ax.text(0.5, 0.5, "no summary.json with tier rates\n(the run has not finished)", ha="center",
                va="center", transform=ax.transAxes, color="grey")  # fmt: skip
        return
    ys = range(len(names))
    for offset, key, color in ((-0.2, "device_hit_rate", "tab:blue"), (0.2, "host_hit_rate", "tab:red")):
        values = [tables[n].get(key, NAN) for n in names]
        ax.barh([y + offset for y in ys], values, height=0.4, color=color, label=key.replace("_", " "))
    ax.set_yticks(list(ys), names, fontsize=8 if len(names) <= 12 else 6)
    ax.invert_yaxis()
    ax.set_xlim(min([0.0, *(v for t in tables.values() for v in t.values())]), 1.0)
