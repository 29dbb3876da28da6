"""The streams ``bench_exchange.py`` trains on: a config file and the ``--set`` overrides that pick it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from recsys.data.source import DataConfig, data_root
from recsys.data.spec import load_spec
from recsys.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
STREAMS = ("quickstart", "requests", "movielens-1m")
MOVIELENS_SPEC = ROOT / "datasets" / "movielens-1m.toml"


@dataclass(frozen=True)
class Stream:
    """A stream: ``config`` (a path ``recsys train --config`` takes, from the repository root) and the
    ``--set`` overrides (``sets``) that make it this benchmark's."""

    name: str
    config: str
    sets: tuple[str, ...]


def stream(name: str, *, interleave: int, eval_samples: int, scratch: Path) -> Stream:
    """The stream ``name``; ``interleave`` is the request stream's, ``eval_samples`` the synthetic held-out
    split's size (the one evaluation at the end of every run; MovieLens keeps its 10%)."""
    if name == "quickstart":
        return Stream(name, "configs/quickstart.toml", (f"synthetic.eval_samples={eval_samples}",))
    if name == "requests":
        sets = (f"synthetic.interleave={interleave}", f"synthetic.eval_samples={eval_samples}")
        return Stream(name, "configs/requests.toml", sets)
    if name == "movielens-1m":
        spec = movielens_in_time_order(scratch)
        return Stream(name, "configs/movielens-1m.toml", (f"data.source={spec}",))
    raise ValueError(f"unknown stream {name!r}; valid: {', '.join(STREAMS)}")


def movielens_in_time_order(scratch: Path) -> Path:
    """A copy of ``datasets/movielens-1m.toml`` in ``scratch`` whose training split is read in time order:
    the spec sorts the ratings by timestamp (``order_by``) and then shuffles each epoch; the copy turns
    ``shuffle`` off, so every epoch is one pass in time order (``[data]`` has no key for it, so ``--set``
    cannot). The copy keeps the spec's ``name``, so it reads the same fetched files. Exits with one line
    when the data is neither in the cache nor fetchable."""
    off = "shuffle = false  # bench_exchange: every epoch is one pass in time order"
    text, count = re.subn(r"(?m)^shuffle = true\b.*$", off, MOVIELENS_SPEC.read_text())
    if count != 1:
        raise SystemExit(f"bench_exchange: {MOVIELENS_SPEC} has no `shuffle = true` line to turn off")
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "movielens-1m-time-order.toml"
    path.write_text(text)
    try:
        data_root(load_spec(path), DataConfig(source=str(path)))  # fetched into the cache if it can be
    except UserError as err:
        raise SystemExit(f"bench_exchange: no MovieLens-1M data here: {err}") from None
    return path
