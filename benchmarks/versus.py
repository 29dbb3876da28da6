"""The arms of one recorded ``bench_alternatives`` run against the arms of another, on the same stream.

    python benchmarks/versus.py benchmarks/results/A.json benchmarks/results/B.json

An arm too long to share a run with the others (the exact memory-mapped table at full size) is recorded in
a run of its own; this prints the figures ``bench_alternatives`` prints for arms of one run, for every arm
of A against every arm of B that A lacks: ``versus.<a>.<b>`` (``last_tenth``, the ratio of samples/s over
the last tenth; ``auc``, the held-out AUC difference; ``disk_bytes`` and ``cpu_per_sample``, ratios), and
for A's ``tierrec`` arm the same flat keys as ``bench_alternatives`` (``over_ram_vs_<b>_last_tenth``,
``over_ram_auc_vs_<b>``, ...), with both runs' commits and dates. Runs of two programs other than
``bench_alternatives``, or whose streams differ (``--steps``, ``--batch``, ``--tables``, ``--eval-samples``,
``--smoke``), are refused (exit 2). The two runs were not alternated: machine drift between them is in
the ratio, which one run of each arm cannot show.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from alternatives.compare import headline_keys, versus
from harness import emit

STREAM = ("steps", "batch", "tables", "eval_samples", "smoke")


def load(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"versus: {path}: not a recorded result ({exc})") from None
    if not isinstance(record, dict) or record.get("program") != "bench_alternatives.py":
        raise SystemExit(f"versus: {path}: not a recorded bench_alternatives run")
    if not isinstance(record.get("result", {}).get("over_ram"), dict):
        raise SystemExit(f"versus: {path}: the run has no larger-than-RAM arms")
    return record


def stream(record: dict[str, Any]) -> dict[str, Any]:
    """The flags that define the run's stream, as the program parsed them (its defaults filled in)."""
    from bench_alternatives import parse  # torch and the project: imported only once the files are read

    parsed = vars(parse([str(a) for a in record.get("argv", [])]))
    return {key: parsed[key] for key in STREAM}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    arms_a, arms_b = a["result"]["over_ram"], b["result"]["over_ram"]
    out: dict[str, Any] = {
        "runs": [{k: r.get(k) for k in ("commit", "date", "argv")} for r in (a, b)],
        "versus": {x: {y: versus(arms_a[x], arms_b[y]) for y in arms_b if y not in arms_a} for x in arms_a},
    }
    out.update(headline_keys(out["versus"].get("tierrec", {})))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="a recorded run (its arms are the candidates)")
    parser.add_argument("b", type=Path, help="another recorded run (its arms are the baselines)")
    args = parser.parse_args(argv)
    a, b = load(args.a), load(args.b)
    sa, sb = stream(a), stream(b)
    if sa != sb:
        differ = {k: [sa[k], sb[k]] for k in STREAM if sa[k] != sb[k]}
        print(f"versus: the two runs trained on different streams: {differ}", file=sys.stderr)
        return 2
    emit(compare(a, b))  # rounded as bench_alternatives prints its own
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
