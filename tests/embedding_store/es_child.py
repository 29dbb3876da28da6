"""Child process of the durability tests: ``python es_child.py MODE STORE_DIR OUT_FILE``.

Modes:
    flush_then_wait: train, flush, dump the store's rows to OUT_FILE, print FLUSHED, sleep.
    flush_then_work: the same, then keep training on other ids (evictions, writer commits) forever.
    hold: open the store, print OPEN, sleep.
    open: try to open the store; print the outcome (OPEN or the exception's class name).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from embedding_store import LmdbOptions, OptimizerKind, StoreConfig, StoreError, TableSpec, TieredStore

SPEC = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
CONFIG = StoreConfig(
    seed=11,
    device_capacity_rows=16,
    host_capacity_rows=8,
    lmdb=LmdbOptions(initial_map_size_bytes=1 << 20, writer_batch_rows=8),
)


def open_store(path: str) -> tuple[TieredStore, torch.Tensor, torch.Tensor]:
    store = TieredStore(path, config=CONFIG, tables=[SPEC])
    weights, state = torch.zeros(16, 4), torch.zeros(16)
    store.bind("t", weights=weights, state=state)
    return store, weights, state


def train(
    store: TieredStore, weights: torch.Tensor, state: torch.Tensor, ids: np.ndarray, batch: int
) -> None:
    """One batch: make resident, change every row in place (as the fused optimizer would), release."""
    slots = store.make_resident(batch, {"t": torch.from_numpy(ids)})["t"].unique()
    weights[slots] += 0.25 * (batch + 1)
    state[slots] += 1.0
    store.release(batch)


def dump(store: TieredStore, out: str) -> None:
    chunks = list(store.iter_rows("t"))
    np.savez(
        out,
        ids=torch.cat([c.ids for c in chunks]).numpy(),
        weights=torch.cat([c.weights for c in chunks]).numpy(),
        state=torch.cat([c.state for c in chunks]).numpy(),
    )


def main() -> None:
    mode, path, out = sys.argv[1:4]
    if mode == "open":
        try:
            TieredStore(path, config=CONFIG, tables=[SPEC]).close()
            print("OPEN", flush=True)
        except StoreError as err:
            print(type(err).__name__, flush=True)
        return
    store, weights, state = open_store(path)
    if mode == "hold":
        print("OPEN", flush=True)
        time.sleep(600)
    rng = np.random.default_rng(0)
    for batch in range(40):  # ids 0..99: far more than the 16 slots + 8 host rows
        train(store, weights, state, rng.integers(0, 100, size=10), batch)
    store.flush()
    dump(store, out)
    print("FLUSHED", flush=True)
    if mode == "flush_then_wait":
        time.sleep(600)
    batch = 1000
    while True:  # ids 1000..1099 only: the flushed rows are evicted and rewritten, never changed
        train(store, weights, state, rng.integers(1000, 1100, size=10), batch)
        batch += 1


if __name__ == "__main__":
    main()
