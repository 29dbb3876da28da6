"""The ``recsys`` command line.

``recsys train --config FILE [--set section.key=value ...] [--out DIR] [--nproc N] [--resume]``
``recsys preprocess FILE... --out DIR [--no-label] [--on-error raise|skip]`` (Criteo TSV → TorchRec npy)
``recsys tune-cache --config FILE --device-budget SIZE --host-budget SIZE [--batches N] --out DIR``
``recsys plan-exchange --config FILE [--set section.key=value ...] [--steps N]`` (bytes per sample of the
pooled and rows exchanges on 2 to 512 ranks, replayed without processes)
``recsys plot --run DIR [--out FILE.png]`` (one PNG of a run's curves; reads JSON only)

User errors (bad config keys or values, missing files, bad ``--set`` syntax) print one line and exit
with code 2. Without torchrun, ``train`` spawns ``train.nproc`` local worker processes itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from recsys.serving import commands as serving

if TYPE_CHECKING:
    from recsys.config import RunConfig

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other user error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="recsys", description="Train DLRM-style recommendation models with tiered embeddings."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train a model from a TOML config")
    train.add_argument("--config", required=True, type=Path, help="TOML config file")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.steps=100",
    )
    train.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<config name>)")
    train.add_argument(
        "--nproc", type=int, default=None, help="local worker processes (overrides train.nproc)"
    )
    train.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in --out"
    )
    train.add_argument(
        "--seeds",
        default=None,
        metavar="LIST",
        help="train once per seed (e.g. 0,1,2 or 0-4) into <out>/seed_<s>/ and report the spread in <out>/seeds.json",
    )
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even though settings that change the model differ from the checkpoint's",
    )
    prep = sub.add_parser("preprocess", help="convert Criteo TSV files to TorchRec's npy layout")
    prep.add_argument("inputs", nargs="+", type=Path, help="Criteo TSV files (plain or .gz)")
    prep.add_argument("--out", required=True, type=Path, help="folder for <name>_{dense,sparse,labels}.npy")
    prep.add_argument("--no-label", action="store_true", help="inputs have no label column (Kaggle test.txt)")
    prep.add_argument(
        "--on-error",
        choices=["raise", "skip"],
        default="raise",
        help="malformed lines: stop, or skip and count",
    )
    tune = sub.add_parser("tune-cache", help="recommend per-table device and host capacities")
    tune.add_argument("--config", required=True, type=Path, help="TOML config of the training run")
    tune.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), as for train",
    )  # fmt: skip
    tune.add_argument(
        "--device-budget", required=True, help="device memory for slot tables, all ranks (e.g. 64MiB)"
    )
    tune.add_argument(
        "--host-budget", required=True, help="host DRAM for the host tier, all ranks (e.g. 1GiB)"
    )
    tune.add_argument(
        "--batches", type=int, default=None, help="training batches to replay (default train.steps)"
    )
    tune.add_argument("--nproc", type=int, default=None, help="ranks of the run (overrides train.nproc)")
    tune.add_argument("--out", required=True, type=Path, help="folder for tune.json, tune.md and plots")
    exchange = sub.add_parser(
        "plan-exchange", help="bytes per sample of the pooled and rows exchanges on 2, 8, 64 and 512 ranks"
    )
    exchange.add_argument("--config", required=True, type=Path, help="TOML config of the training run")
    exchange.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), as for train",
    )  # fmt: skip
    exchange.add_argument(
        "--steps", type=int, default=20, help="training batches per rank to replay, from step 0 (default 20)"
    )
    serving.register(sub)  # evaluate, export, predict
    plot = sub.add_parser("plot", help="draw a run's loss, held-out metrics and tier hit rates as one PNG")
    plot.add_argument("--run", required=True, type=Path, help="run directory (as given to train --out)")
    plot.add_argument("--out", type=Path, default=None, help="PNG file (default: DIR/curves.png)")
    return parser


def quiet_libraries() -> None:
    """Keep third-party chatter (planner hints, deprecations) out of the user's terminal."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torchrec")
    for name in ("torchrec", "torch.distributed", "torch.fx._symbolic_trace", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    log = logging.getLogger("recsys")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[recsys] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def summary_lines(summary: dict) -> list[str]:
    """The lines after ``done:``: the splits beside the constant predictor, and the best evaluation."""
    lines = []
    splits = summary.get("splits") or {}
    shown = []
    for name, label in (("train", "training"), ("eval", "held-out")):
        if split := splits.get(name):
            rate = split["positive_rate"]
            shown.append(
                f"{label} {split['rows']:,} rows ({'n/a' if rate is None else f'{rate:.2%}'} positive)"
            )
    if shown:
        lines.append("splits: " + ", ".join(shown))
    if summary.get("constant_logloss") is not None:
        constant, logloss = summary["constant_logloss"], summary["logloss"]
        verdict = "better" if logloss is not None and logloss < constant else "NOT BETTER"
        lines.append(
            f"baseline: the constant predictor's held-out logloss is {constant:.4f}; the model is {verdict}"
        )
    if best := summary.get("best"):
        lines.append(
            f"best: step {best['step']}, auc {_num(best['auc'], '.4f')}, logloss {_num(best['logloss'], '.4f')}, "
            f"digest {best['digest']} (checkpoint in {best['checkpoint']})"
        )
    return lines


def _num(value: float | None, spec: str) -> str:
    """A summary number as text; strict JSON writes an undefined one (a NaN) as null."""
    return "n/a" if value is None else format(value, spec)


def _fail(message: str) -> int:
    print(f"recsys: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _train(args: argparse.Namespace) -> int:
    from recsys.config import load_config
    from recsys.data.source import check_source
    from recsys.errors import UserError
    from recsys.local_env import free_port, launched_by_torchrun

    overrides = list(args.overrides)
    if args.nproc is not None:
        if args.nproc < 1:
            return _fail(f"--nproc must be >= 1, got {args.nproc}")
        overrides.append(f"train.nproc={args.nproc}")
    try:
        config = load_config(args.config, overrides)
        check_source(config.data)  # a bad dataset spec fails here, before any worker starts
        _check_data_columns(config)  # and a field whose column the data lacks
        if config.store.tiered and config.store.capacities_from:  # fail before spawning workers
            from recsys.store_config import load_tune

            load_tune(config.store.capacities_from)
    except UserError as err:
        return _fail(str(err))
    out = args.out or Path("runs") / args.config.stem
    if args.seeds is not None:
        return _train_seeds(args, overrides, out)
    if args.resume and not (out / "checkpoints").is_dir():
        return _fail(f"--resume: no checkpoints in {out}")
    if args.resume:
        from recsys.checkpoint import check_resume_settings

        try:
            check_resume_settings(out / "checkpoints", config)  # before any worker starts
        except UserError as err:
            return _fail(str(err))
    if launched_by_torchrun():
        from recsys.lifetime import RunStopped
        from recsys.train import run

        try:
            summary = run(config, out, resume=args.resume, allow_config_change=args.allow_config_change)
        except UserError as err:
            return _fail(str(err))
        except RunStopped as stop:
            print(f"recsys: {stop}", file=sys.stderr)
            return stop.exit_code
    else:
        from recsys.launch import launch

        try:
            resume = {"resume": args.resume, "allow_config_change": args.allow_config_change}
            code = launch(config, out, resume=resume, port=free_port())
        except UserError as err:
            return _fail(str(err))
        if code:
            return code
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if summary is not None:
        _print_done(summary, out)
    return 0


def _check_data_columns(config: RunConfig) -> None:
    """The dataset spec's columns against the data files' headers (headers only; fetched data is fetched
    here, once, for the workers to find in the cache)."""
    from recsys.data.source import data_root, spec_of
    from recsys.data.spec import Format
    from recsys.data.spec_dataset import check_columns

    spec = spec_of(config.data)
    if spec is None or spec.format is Format.SYNTHETIC:
        return
    check_columns(spec, data_root(spec, config.data))


def _print_done(summary: dict, out: Path) -> None:
    print(
        f"done: {summary['steps']} steps, test auc {_num(summary['auc'], '.4f')}, "
        f"logloss {_num(summary['logloss'], '.4f')}, {_num(summary['samples_per_s'], ',.0f')} samples/s; "
        f"digest {summary['model_digest']}"
    )
    for line in summary_lines(summary):
        print(line)
    print(f"wrote {out / 'summary.json'} and {out / 'metrics.jsonl'}")
    print(f"curves: recsys plot --run {shlex.quote(str(out))}")


def _train_seeds(args: argparse.Namespace, overrides: list[str], out: Path) -> int:
    """``recsys train --seeds``: one local run per seed, then the spread over the seeds."""
    from recsys.config import load_config
    from recsys.errors import UserError
    from recsys.launch import launch
    from recsys.local_env import free_port, launched_by_torchrun
    from recsys.seeds import parse_seeds, train_seeds

    if launched_by_torchrun():
        return _fail("--seeds starts its own workers: run it without torchrun")
    try:
        seeds = parse_seeds(args.seeds)
        configs = {s: load_config(args.config, [*overrides, f"train.seed={s}"]) for s in seeds}
    except UserError as err:
        return _fail(str(err))

    def train_one(seed: int, run_dir: Path, resume: bool) -> int:
        print(f"seed {seed}: training into {run_dir}", flush=True)
        try:
            if resume:
                from recsys.checkpoint import check_resume_settings

                check_resume_settings(run_dir / "checkpoints", configs[seed])
            code = launch(
                configs[seed], run_dir, port=free_port(),
                resume={"resume": resume, "allow_config_change": args.allow_config_change},
            )  # fmt: skip
        except UserError as err:
            return _fail(str(err))
        if not code:
            _print_done(json.loads((run_dir / "summary.json").read_text()), run_dir)
        return code

    steps = configs[seeds[0]].train.steps
    code, summary = train_seeds(seeds, out, steps=steps, resume=args.resume, train_one=train_one)
    if summary is None:
        return code
    print(f"{'seed':>6} {'auc':>8} {'logloss':>8} {'constant':>8}")
    for seed in summary["seeds"]:
        r = summary["runs"][str(seed)]
        print(
            f"{seed:>6} {_num(r['auc'], '8.4f')} {_num(r['logloss'], '8.4f')} {_num(r['constant_logloss'], '8.4f')}"
        )
    for metric in ("auc", "logloss"):
        f = summary["final"][metric]
        if f["median"] is not None:
            print(
                f"{metric}: median {f['median']:.4f}, mean {f['mean']:.4f} ± {f['std']:.4f} "
                f"(min {f['min']:.4f}, max {f['max']:.4f}) over {len(seeds)} seeds"
            )
    print(f"wrote {out / 'seeds.json'}")
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from recsys.data.issues import OnError
    from recsys.data.preprocess import criteo_tsv_to_npy
    from recsys.errors import UserError

    try:
        prefixes = criteo_tsv_to_npy(
            args.inputs, args.out, on_error=OnError(args.on_error), has_label=not args.no_label
        )
    except UserError as err:
        return _fail(str(err))
    print(f"wrote {', '.join(f'{p}_{{dense,sparse,labels}}.npy' for p in prefixes)}")
    return 0


def _tune_cache(args: argparse.Namespace) -> int:
    from recsys.config import load_config
    from recsys.errors import UserError
    from recsys.store_config import parse_size
    from recsys.tune.report import PLOTS_HINT, apply_command, write_outputs
    from recsys.tune.tuner import tune

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"train.nproc={args.nproc}")
    try:
        budgets = {}
        for flag, text in (("--device-budget", args.device_budget), ("--host-budget", args.host_budget)):
            try:
                budgets[flag] = parse_size(text.strip())
            except ValueError as err:
                raise UserError(f"{flag}: {err}") from None
        config = load_config(args.config, overrides)
        result = tune(
            config, device_budget=budgets["--device-budget"], host_budget=budgets["--host-budget"],
            batches=args.batches,
        )  # fmt: skip
        # The apply: line repeats every override, --nproc's too: the tune's capacities are per owner.
        paths = write_outputs(result, args.out, config_path=str(args.config), overrides=overrides)
    except UserError as err:
        return _fail(str(err))
    doc = result.doc
    for name, t in doc["tables"].items():
        print(
            f"{name}: device_rows {t['device_rows']:,} (hit rate {t['predicted_device_hit_rate']:.3f}), "
            f"host_rows {t['host_rows']:,} (host hit rate {t['predicted_host_hit_rate']:.3f}), "
            f"{t['ssd_rows_per_step']:.1f} SSD rows/step"
        )
    total = doc["total"]
    line = f"total: device hit rate {total['predicted_device_hit_rate']:.3f}, {total['ssd_rows_per_step']:.1f} SSD rows/step"
    if doc.get("equal_split"):
        eq = doc["equal_split"]
        line += f" (equal split: {eq['predicted_device_hit_rate']:.3f}, {eq['ssd_rows_per_step']:.1f})"
    print(line)
    if not any(p.suffix == ".png" for p in paths):
        print(f"note: {PLOTS_HINT}")
    print(f"wrote {', '.join(str(p) for p in paths)}")
    print(f"apply: {apply_command(str(args.config), overrides, args.out / 'tune.json')}")
    return 0


def _plan_exchange(args: argparse.Namespace) -> int:
    from recsys.config import load_config
    from recsys.errors import UserError

    if args.steps < 1:
        return _fail(f"--steps must be >= 1, got {args.steps}")
    try:
        config = load_config(args.config, args.overrides)
        from recsys.exchange_replay import ReplaySetup, plan_exchange, report_lines  # torch: after the config

        setup = ReplaySetup.from_config(config)
        results = plan_exchange(setup, steps=args.steps)
    except UserError as err:
        return _fail(str(err))
    for line in report_lines(setup, results, steps=args.steps):
        print(line)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from recsys.errors import UserError
    from recsys.plot import describe, plot_run  # JSON and matplotlib only: no torch

    try:
        path, curves, torn = plot_run(args.run, args.out)
    except UserError as err:
        return _fail(str(err))
    if torn:
        print("note: left out the unfinished last line of metrics.jsonl (a run still writing?)")
    for line in describe(curves):
        print(line)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    quiet_libraries()
    if args.command == "train":
        return _train(args)
    if args.command == "preprocess":
        return _preprocess(args)
    if args.command == "tune-cache":
        return _tune_cache(args)
    if args.command == "plan-exchange":
        return _plan_exchange(args)
    if args.command == "plot":
        return _plot(args)
    if args.command in serving.COMMANDS:
        return serving.run(args)
    return _fail(f"unknown command {args.command!r}")


def entry() -> None:
    sys.exit(main())
