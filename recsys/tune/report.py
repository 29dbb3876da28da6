"""The outputs of ``recsys tune-cache``: tune.json, tune.md and one PNG of curves per table."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from recsys.metrics import write_json
from recsys.plot import PLOTS_HINT
from recsys.tune.tuner import TuneResult

__all__ = ["apply_command", "write_outputs", "PLOTS_HINT"]


def apply_command(config_path: str, overrides: list[str], tune_json: Path) -> str:
    """The ``recsys train`` command that applies a tune: the config, every override of the tune (its
    ``--nproc`` among them) and ``store.capacities_from``, each quoted for a POSIX shell."""
    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    tuned = shlex.quote(f"store.capacities_from={tune_json}")
    return f"recsys train --config {shlex.quote(config_path)}{sets} --set {tuned}"


def write_outputs(
    result: TuneResult, out: Path, *, config_path: str, overrides: list[str] | None = None
) -> list[Path]:
    """Write tune.json, tune.md and the plots into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"config": config_path, **result.doc, "curves": result.curves}
    paths = [out / "tune.json"]
    write_json(paths[0], doc)  # strict JSON: NaN and ±inf as null
    plots = _plots(result, out)
    md = out / "tune.md"
    md.write_text(_markdown(result, out, config_path=config_path, plots=plots, overrides=overrides or []))
    return [*paths, md, *plots]


def _pct(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _markdown(
    result: TuneResult, out: Path, *, config_path: str, plots: list[Path], overrides: list[str]
) -> str:
    doc = result.doc
    lines = [
        f"# Cache tuning for `{config_path}`",
        "",
        f"Replayed {doc['batches']} training batches on {doc['world_size']} rank(s), {doc['sharding']} sharding; "
        f"policy `{doc['policy']}` with lookahead {doc['lookahead']}; {doc['pinned_batches']} batches pinned "
        "at each fill.",
        f"Device budget {doc['device_budget_bytes']:,} bytes (uses {doc['device_bytes']:,}), host budget "
        f"{doc['host_budget_bytes']:,} bytes (uses {doc['host_bytes']:,}); budgets are totals over all ranks.",
        "",
        "| table | device rows | host rows | predicted device hit rate | predicted host hit rate | "
        "SSD rows / step | min device rows | distinct ids | sample rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, t in doc["tables"].items():
        lines.append(
            f"| {name} | {t['device_rows']:,} | {t['host_rows']:,} | {_pct(t['predicted_device_hit_rate'])} | "
            f"{_pct(t['predicted_host_hit_rate'])} | {t['ssd_rows_per_step']:.1f} | {t['min_device_rows']:,} | "
            f"{t['distinct_ids']:,} | {t['sample_rate']:.3g} |"
        )
    total = doc["total"]
    lines += [
        "",
        f"Total: device hit rate {_pct(total['predicted_device_hit_rate'])}, host hit rate "
        f"{_pct(total['predicted_host_hit_rate'])}, {total['ssd_rows_per_step']:.1f} SSD rows per step.",
    ]
    eq = doc.get("equal_split")
    if eq:
        lines.append(
            f"An equal split of the same budgets: device hit rate {_pct(eq['predicted_device_hit_rate'])}, "
            f"host hit rate {_pct(eq['predicted_host_hit_rate'])}, {eq['ssd_rows_per_step']:.1f} SSD rows per step."
        )
    else:
        lines.append("An equal split of the device budget cannot hold every table's batches in flight.")
    lines += [
        "",
        "`host hit rate`: the share of rows filled into the device tier that came from host DRAM rather than "
        "LMDB or a first initialisation. Hit rates are over training batches.",
        "",
        "## Apply",
        "",
        "```bash",
        apply_command(config_path, overrides, out / "tune.json"),
        "```",
        "",
        "or paste into the config:",
        "",
        "```toml",
        doc["snippet"].rstrip(),
        "```",
        "",
        "## Curves (device hit rate against device rows per owner)",
        "",
    ]
    for name, c in result.curves.items():
        header = "| rows | " + " | ".join(k for k in c if k != "capacity") + " |"
        lines += [f"### {name}", "", header, "|" + "---|" * (len(c))]
        for i, cap in enumerate(c["capacity"]):
            lines.append(
                f"| {int(cap):,} | " + " | ".join(_pct(c[k][i]) for k in c if k != "capacity") + " |"
            )
        lines.append("")
    if plots:
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    else:
        lines.append(f"(No plots: {PLOTS_HINT}.)")
    return "\n".join(lines) + "\n"


def _plots(result: TuneResult, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    doc = result.doc
    paths = []
    for name, c in result.curves.items():
        t = doc["tables"][name]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for key, style in (
            ("belady", "-"),
            ("lookahead", "-"),
            ("lfu", "--"),
            ("lru", "--"),
            ("lru_stack", ":"),
        ):
            ys = [float("nan") if v is None else v for v in c[key]]
            ax.plot(c["capacity"], ys, style, marker=".", label=key.replace("_", " "))
        policy = doc["policy"]
        ax.axvline(t["device_rows"], color="k", lw=0.8)
        ax.plot([t["device_rows"]], [t["predicted_device_hit_rate"]], "k*", ms=12, label="chosen device rows")
        ax.axvline(
            t["device_rows"] + t["host_rows"], color="grey", lw=0.8, ls="--", label="device + host rows"
        )
        ax.set_xlabel("rows per owner")
        ax.set_ylabel("device hit rate")
        ax.set_title(f"{name}: hit rate against capacity ({policy} is the configured policy)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = out / f"curves_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
