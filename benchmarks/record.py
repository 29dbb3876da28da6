"""Run one benchmark program and keep its result: the figures docs/performance.md quotes are files here.

    python benchmarks/record.py bench_store.py [the program's flags]

runs ``benchmarks/<program>`` with those flags (its output shown as it comes), then writes its last line,
the JSON result every program ends with, to ``benchmarks/results/<program>_<UTC date-time>_<commit>.json``
as ``{"program", "argv", "commit", "date", "exit_code", "result"}``. A result names the commit it measured,
so a tree with uncommitted changes to tracked files is refused (``--allow-dirty`` records it anyway, the
commit marked ``+dirty``), and so is a run that failed (nothing is written). ``--results DIR`` writes
elsewhere. Exits with the program's exit code. ``versus.py A.json B.json`` (one recorded
``bench_alternatives`` run's arms against another's) is recorded the same way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", help="a program in benchmarks/, e.g. bench_store.py")
    parser.add_argument("--results", type=Path, default=BENCHMARKS / "results")
    parser.add_argument(
        "--allow-dirty", action="store_true", help="record from a tree with uncommitted changes"
    )
    args, flags = parser.parse_known_args(argv)
    program = BENCHMARKS / args.program
    recordable = program.name.startswith("bench_") or program.name == "versus.py"
    if program.parent != BENCHMARKS or not recordable or not program.is_file():
        parser.error(f"{args.program!r} is not a benchmark program in {BENCHMARKS}")
    commit = git("rev-parse", "--short=12", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        if not args.allow_dirty:
            parser.error("the tree has uncommitted changes: commit them, or pass --allow-dirty")
        commit += "+dirty"
    date = datetime.datetime.now(datetime.UTC)
    proc = subprocess.Popen(
        [sys.executable, str(program), *flags], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    last = ""
    for line in proc.stdout:  # shown as it comes; the last non-empty line is the result
        sys.stdout.write(line)
        if line.strip():
            last = line
    code = proc.wait()
    if code != 0:
        print(f"record: {args.program} exited with {code}; nothing recorded", file=sys.stderr)
        return code
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        print(f"record: {args.program} did not end with a JSON line; nothing recorded", file=sys.stderr)
        return code or 1
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{program.stem}_{date:%Y%m%d-%H%M%S}_{commit}.json"
    record = {
        "program": program.name,
        "argv": flags,
        "commit": commit,
        "date": date.isoformat(timespec="seconds"),
        "exit_code": code,
        "result": result,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: wrote {path}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
