"""The LMDB backend's reads of a bounded table that started empty look up only ids it was given (B-tree layout;
the log layout's index knows the stored ids)."""

from __future__ import annotations

import numpy as np

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.backends.btree import BTreeBackend
from embedding_store.backends.lmdb_env import open_env

BOUNDED = TableSpec(name="b", dim=2, optimizer=OptimizerKind.EXACT_SGD, num_embeddings=1000)
UNBOUNDED = TableSpec(name="u", dim=2, optimizer=OptimizerKind.EXACT_SGD)


class _Counting(BTreeBackend):
    """Records the ids of every LMDB lookup."""

    def __init__(self, path, *, options, seed, tables) -> None:  # type: ignore[no-untyped-def]
        self.looked_up: list[int] = []
        super().__init__(open_env(path, options, len(tables)), options=options, seed=seed, tables=tables)

    def _get_chunk(self, table, ids):  # type: ignore[no-untyped-def]
        self.looked_up += ids.tolist()
        return super()._get_chunk(table, ids)


def test_only_ids_ever_written_are_looked_up_until_the_store_is_reopened(tmp_path) -> None:
    def open_backend() -> _Counting:
        return _Counting(
            tmp_path / "env", options=LmdbOptions(layout="btree"), seed=0, tables=[BOUNDED, UNBOUNDED]
        )

    written = np.array([3, 10, 500])
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    ids = np.array([1, 3, 7, 10, 499, 500, 999])
    want_found = np.isin(ids, written)
    backend = open_backend()
    backend.put_rows([("b", written, rows), ("u", written, rows)])
    for table, looked_up in (("b", written.tolist()), ("u", ids.tolist())):  # unbounded: no flags
        backend.looked_up.clear()
        found, got = backend.get_rows(table, ids)
        assert np.array_equal(found, want_found) and np.array_equal(got, rows)
        assert backend.looked_up == looked_up
    backend.close()
    backend = open_backend()  # not empty now: rows of an earlier session may be anywhere
    found, got = backend.get_rows("b", ids)
    assert np.array_equal(found, want_found) and np.array_equal(got, rows)
    assert backend.looked_up == ids.tolist()
    backend.close()
