"""The ``recsys evaluate``, ``recsys export``, ``recsys predict`` and ``recsys recommend`` commands.

``register(sub)`` adds their parsers to the CLI's subparsers; ``run(args)`` runs the one parsed. Heavy
modules are imported when a command runs, so that ``recsys --help`` stays quick.

``recsys evaluate --run DIR [--checkpoint STEP|best|PATH] [--set section.key=value ...] [--nproc N] [--out FILE]``
``recsys export --run DIR [--checkpoint STEP|best|PATH] --out BUNDLE [--buffer-rows N] [--keep-optimizer-state]``
``recsys predict --bundle BUNDLE --out FILE [--data SPEC_OR_CONFIG] [--split eval|train|all | --input FILE[,FILE...]]
[--keep COL[,COL...]] [--rows N] ...``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["COMMANDS", "register", "run"]

COMMANDS = ("evaluate", "export", "predict", "recommend")
EXIT_USAGE = 2


def _overrides(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help=f"override one config value (repeatable), {what}",
    )  # fmt: skip


def register(sub: Any) -> None:
    """Add the serving commands to ``sub`` (the CLI's ``add_subparsers`` object)."""
    ev = sub.add_parser("evaluate", help="AUC and log loss of a checkpoint on the held-out split")
    ev.add_argument("--run", required=True, type=Path, help="run directory (as given to train --out)")
    ev.add_argument(
        "--checkpoint", default=None, help="step number, best, or a checkpoint directory (default: newest)"
    )
    _overrides(ev, "e.g. --set data.path=other/files --set eval.batch_size=8192")
    ev.add_argument(
        "--nproc", type=int, default=None, help="local ranks (default: as many as wrote the checkpoint)"
    )
    ev.add_argument(
        "--out", type=Path, default=None, help="JSON file (default: DIR/evaluate_step_NNNNNNNN.json)"
    )

    ex = sub.add_parser("export", help="write a self-contained serving bundle of a checkpoint")
    ex.add_argument("--run", required=True, type=Path, help="run directory (as given to train --out)")
    ex.add_argument(
        "--checkpoint", default=None, help="step number, best, or a checkpoint directory (default: newest)"
    )
    ex.add_argument("--out", required=True, type=Path, help="bundle directory to create")
    ex.add_argument(
        "--buffer-rows", type=int, default=1 << 16, help="rows held in memory at once (default 65536)"
    )
    ex.add_argument(
        "--keep-optimizer-state",
        action="store_true",
        help="keep each row's optimizer state (default: weights only)",
    )

    pr = sub.add_parser("predict", help="score a dataset with a bundle and write one score per row")
    pr.add_argument("--bundle", required=True, type=Path, help="bundle directory written by recsys export")
    pr.add_argument("--out", required=True, type=Path, help="output file: .csv, .csv.gz, .parquet or .pq")
    pr.add_argument(
        "--data", default=None, help="run config or dataset spec (default: the bundle's training config)"
    )
    pr.add_argument(
        "--split", choices=["eval", "train", "all"], default=None, help="rows to score (default eval)"
    )
    pr.add_argument(
        "--input", default=None, metavar="FILE[,FILE...]",
        help="score these files whole (no split), read with the training spec's layout",
    )  # fmt: skip
    pr.add_argument(
        "--keep", default=None, metavar="COL[,COL...]",
        help="columns of the input files to write beside each score (e.g. a request id)",
    )  # fmt: skip
    pr.add_argument("--rows", type=int, default=None, help="score at most this many rows")
    pr.add_argument("--batch-size", type=int, default=4096, help="rows scored at once (default 4096)")
    pr.add_argument(
        "--cache-rows", type=int, default=1 << 16, help="cached rows per tiered table (default 65536)"
    )
    pr.add_argument(
        "--no-verify", action="store_true", help="skip the bundle's checksums (sizes are still checked)"
    )
    _overrides(pr, "e.g. --set data.path=other/files")

    rc = sub.add_parser("recommend", help="the top K candidates of every user, scored with a bundle")
    rc.add_argument("--bundle", required=True, type=Path, help="bundle directory written by recsys export")
    rc.add_argument(
        "--users", required=True, type=Path, help="users file: a header and the user-side columns"
    )
    rc.add_argument(
        "--candidates", required=True, type=Path, help="candidates file: a header and the item-side columns"
    )
    rc.add_argument("--k", type=int, default=10, help="candidates kept per user (default 10)")
    rc.add_argument("--out", required=True, type=Path, help="output file: .csv, .csv.gz, .parquet or .pq")
    rc.add_argument("--user-column", default=None, help="the users' key column (default: the first)")
    rc.add_argument("--item-column", default=None, help="the candidates' key column (default: the first)")
    rc.add_argument("--batch-size", type=int, default=4096, help="pairs scored at once (default 4096)")
    rc.add_argument(
        "--cache-rows", type=int, default=1 << 16, help="cached rows per tiered table (default 65536)"
    )


def _fail(message: str) -> int:
    print(f"recsys: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _evaluate(args: argparse.Namespace) -> int:
    from recsys.local_env import launched_by_torchrun
    from recsys.metrics import write_json
    from recsys.serving.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(
        args.run, checkpoint=args.checkpoint, overrides=tuple(args.overrides), nproc=args.nproc
    )[0]
    if launched_by_torchrun() and int(os.environ.get("RANK", "0")) != 0:
        return 0
    out = args.out or args.run / f"evaluate_step_{result['step']:08d}.json"
    record = {"run": str(args.run), **result, "overrides": list(args.overrides)}
    write_json(out, record)
    auc = "n/a" if result["auc"] != result["auc"] else f"{result['auc']:.6f}"
    ranked = "".join(
        f", {name} {result[name]:.6f}" for name in ("gauc", "ndcg_at_10", "recall_at_10") if name in result
    )
    print(
        f"step {result['step']}: auc {auc}, logloss {result['logloss']:.6f}{ranked} "
        f"({result['world_size']} rank(s))"
    )
    print(f"wrote {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from recsys.serving.export import ExportOptions, export_bundle

    options = ExportOptions(buffer_rows=args.buffer_rows, keep_optimizer_state=args.keep_optimizer_state)
    report = export_bundle(args.run, args.out, checkpoint=args.checkpoint, options=options)
    tables = ", ".join(
        f"{name} {t['rows']:,} rows, {t['bytes'] / 2**20:.1f} MiB ({t['kind']})"
        for name, t in report["tables"].items()
    )
    print(f"exported step {report['step']} in {report['seconds']:.1f} s: {tables}")
    print(f"wrote {report['bundle']} ({report['bytes'] / 2**20:.1f} MiB)")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from recsys.serving.predict import predict

    options = {
        "batch_size": args.batch_size,
        "cache_rows": args.cache_rows,
        "rows": args.rows,
        "overrides": list(args.overrides),
        "verify": not args.no_verify,
    }
    if args.rows is not None and args.rows < 1:
        return _fail(f"--rows must be >= 1, got {args.rows}")
    if args.input is not None and args.split is not None:
        return _fail("--input scores the files whole: it takes no --split")
    inputs = [Path(p) for p in args.input.split(",") if p] if args.input is not None else []
    if args.input is not None and not inputs:
        return _fail("--input needs at least one file")
    keep = [c.strip() for c in args.keep.split(",") if c.strip()] if args.keep is not None else []
    report = predict(
        args.bundle,
        args.out,
        data=args.data,
        split=args.split or "eval",
        inputs=inputs,
        keep=keep,
        options=options,
    )
    rates = ", ".join(f"{f} {c['hit_rate']:.3f}" for f, c in report["cache"].items())
    shares = ", ".join(f"{f} {d['share']:.3f}" for f, d in report["defaults"].items())
    print(
        f"scored {report['rows']:,} rows"
        + (f"; cache hit rates: {rates}" if rates else "")
        + (f"; default row shares: {shares}" if shares else "")
    )
    print(f"wrote {report['out']}")
    return 0


def _recommend(args: argparse.Namespace) -> int:
    from recsys.serving.recommend import recommend

    report = recommend(
        args.bundle,
        args.users,
        args.candidates,
        args.out,
        k=args.k,
        user_column=args.user_column,
        item_column=args.item_column,
        batch_size=args.batch_size,
        cache_rows=args.cache_rows,
    )
    print(
        f"scored {report['pairs']:,} pairs ({report['users']:,} users x {report['candidates']:,} candidates) "
        f"in {report['seconds']:.1f} s: {report['pairs_per_s']:,.0f} pairs/s"
    )
    print(f"wrote {report['out']}")
    return 0


class _Stopped(BaseException):
    """SIGTERM during export or predict, raised like SIGINT's KeyboardInterrupt (no ``except Exception``
    catches it), so that the command removes what it was writing on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`_Stopped` (once: a second SIGTERM kills at once)."""

    def stop(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise _Stopped(signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (run as a library): no handler, SIGTERM's default
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    """Run the parsed serving command; a user error is one line on stderr and exit code 2. SIGINT or
    SIGTERM during export or predict: one line, nothing written, exit code 128 + the signal's number
    (as ``recsys train`` stopped by a signal)."""
    from recsys.errors import UserError

    handler = {"evaluate": _evaluate, "export": _export, "predict": _predict, "recommend": _recommend}[
        args.command
    ]
    if args.command == "evaluate":  # its ranks have their own signal handling
        try:
            return handler(args)
        except UserError as err:
            return _fail(str(err))
    try:
        with _sigterm_stops():
            return handler(args)
    except UserError as err:
        return _fail(str(err))
    except (KeyboardInterrupt, _Stopped) as stop:
        signum = stop.signum if isinstance(stop, _Stopped) else signal.SIGINT
        what = f"no bundle was written to {args.out}"
        if args.command in ("predict", "recommend"):
            what = f"{args.out} was not written (a file already there is left as it was)"
        print(f"recsys: {args.command} stopped by {signal.Signals(signum).name}; {what}", file=sys.stderr)
        return 128 + signum
