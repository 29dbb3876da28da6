"""The file ``recsys predict`` writes: scores to CSV or Parquet (by the suffix), appended batch by batch
into a temporary file beside the output that is renamed into place at the end, or removed."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from recsys.errors import UserError
from recsys.serving.output import temporary

__all__ = ["ScoreFile", "out_kind", "PARQUET_GROUP_ROWS"]

PARQUET_GROUP_ROWS = 1 << 16  # rows per Parquet row group


class ScoreFile:
    """Rows out to CSV or Parquet (by the file's suffix), appended batch by batch, into a temporary file
    beside ``path`` that :meth:`close` renames into place (``keep``) or removes."""

    def __init__(self, path: Path, kind: str, columns: list[str]) -> None:
        self.path, self.kind, self.columns = path, kind, columns
        self._tmp = temporary(path)
        self._pending: list[dict[str, Any]] = []
        self._pending_rows = 0
        self._file: Any = None
        self._parquet: Any = None
        try:
            self._open()
        except BaseException:
            self.close(keep=False)
            raise

    def _open(self) -> None:
        if self.kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            types = {"line": pa.int64(), "row": pa.int64(), "rank": pa.int64(), "label": pa.float32()}
            types |= {"logit": pa.float32(), "score": pa.float32()}
            self._pa = pa
            self._schema = pa.schema([(c, types.get(c, pa.string())) for c in self.columns])
            self._parquet = pq.ParquetWriter(self._tmp, self._schema)
            return
        import gzip

        # Open for the writer's lifetime; close() ends it (on success and on failure alike).
        opener = gzip.open if self.path.name.lower().endswith(".gz") else open
        self._file = opener(self._tmp, "wt", newline="")  # noqa: SIM115
        self._csv = csv.writer(self._file, lineterminator="\n")
        self._csv.writerow(self.columns)

    def write(self, columns: dict[str, Any]) -> None:
        import numpy as np

        if self.kind == "csv":
            text = []
            for name in self.columns:
                values = columns[name]
                if name in ("logit", "score"):
                    values = np.char.mod("%.9g", values)
                elif name == "label":
                    values = np.char.mod("%g", values)
                text.append(values)
            self._csv.writerows(zip(*text, strict=True))
            return
        self._pending.append(columns)
        self._pending_rows += len(columns["score"])
        if self._pending_rows >= PARQUET_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        self._flush_to(self._parquet)

    def _flush_to(self, parquet: Any) -> None:
        import numpy as np

        if not self._pending:
            return
        data = {c: np.concatenate([p[c] for p in self._pending]) for c in self.columns}
        parquet.write_table(self._pa.table(data, schema=self._schema))
        self._pending, self._pending_rows = [], 0

    def close(self, *, keep: bool) -> None:
        """Finish the file and rename it into place (``keep``), or remove it; whatever fails, no
        temporary file stays behind."""
        try:
            if self._parquet is not None:
                parquet, self._parquet = self._parquet, None
                if keep:
                    self._flush_to(parquet)
                parquet.close()
            if self._file is not None:
                file, self._file = self._file, None
                file.close()
            if keep:
                os.replace(self._tmp, self.path)
        finally:
            if not keep or self._tmp.exists():
                self._tmp.unlink(missing_ok=True)


def out_kind(out: Path) -> str:
    name = out.name.lower()
    if name.endswith((".parquet", ".pq")):
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise UserError(
                "Parquet output needs pyarrow: pip install 'tierrec[parquet]' (or write .csv)"
            ) from None
        return "parquet"
    if name.endswith((".csv", ".csv.gz")):
        return "csv"
    raise UserError(f"--out {out}: the suffix must be .csv, .csv.gz, .parquet or .pq")
