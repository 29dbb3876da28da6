"""Raw records in, model inputs out: the dataset spec's field transforms, carried by the bundle.

A bundle records the dataset spec its model was trained on (``model.json``'s ``spec``: format, read
layout, label, and every ``[[dense]]`` / ``[[sparse]]`` field with its column, kind, id space, separator,
``transform``, ``shift``, ``scale`` and ``fill``). :class:`RawFields` turns records — mappings of column
name to the value as it appears in the data — into the dense matrix and the sparse ids the scorer takes,
by the very code the training readers run (:func:`recsys.data.tabular.to_block` over the same field
parsers, or :func:`recsys.data.criteo.parse_criteo`), so a raw record scores exactly as its line in the
training file would.

Values are strings as in the file, or numbers (written as text, ``repr`` for floats, which round-trips),
or None / ``""`` for an empty field. A record may hold other keys (a request's ids, say); a needed
column it lacks is an error. Data trained from Parquet takes values of the Parquet column's type
(integers stay ids, strings are hashed), through the Parquet reader's code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from recsys.data.criteo import DENSE_NAMES, NUM_SPARSE, SPARSE_NAMES, parse_criteo
from recsys.data.fields import split_fields
from recsys.data.issues import Issues, MalformedInputError, OnError, Problems
from recsys.data.spec import DatasetSpec, Format, spec_from_dict
from recsys.data.tabular import ArrowTable, Table, TextTable, needed_columns, to_block
from recsys.errors import UserError

__all__ = ["RawFields", "bundle_spec"]

# The field separator of the text that records are written into: a byte no field may contain (Criteo's
# layout is tab-separated, as its parser expects).
_SEP, _CRITEO_SEP = "\x1f", "\t"
_WHERE = "record"


def bundle_spec(model: Mapping[str, Any], where: str = "model.json") -> DatasetSpec | None:
    """The dataset spec a bundle's model was trained on (its ``model.json`` as parsed), or None when the
    data had no spec (synthetic data, a factory).

    Raises:
        UserError: the recorded spec is malformed (one line).
    """
    tree = model.get("spec")
    if tree is None:
        return None
    if not isinstance(tree, dict):
        raise UserError(f"{where}: spec must be an object, got {type(tree).__name__}")
    return spec_from_dict(tree, path=f"{where} spec")


class RawFields:
    """Turns raw records into the scorer's inputs with a spec's field transforms.

    Args:
        spec: the dataset spec of the training data.
        feature_names: the model's sparse features (each must be one of the spec's).

    Example:
        >>> fields = RawFields(spec, ["user", "item"])
        >>> dense, sparse = fields.encode([{"user": "u1", "item": "i9", "age": "31"}])
    """

    def __init__(self, spec: DatasetSpec, feature_names: Sequence[str]) -> None:
        if spec.format in (Format.SYNTHETIC, Format.TORCHREC_NPY):
            raise ValueError(
                f"this model was trained on {spec.format.value} data, which has no raw form: score ids and "
                "dense values with scorer(dense, sparse)"
            )
        # Scoring reads no label, and the rows are not split: what to_block needs of the spec.
        self.spec = dataclasses.replace(
            spec,
            read=dataclasses.replace(spec.read, has_label=False),
            split=dataclasses.replace(spec.split, order_by="", group_by=""),
        )
        if spec.format is Format.CRITEO_TSV:
            names = [s.name for s in spec.sparse] or [f"cat_{i}" for i in range(NUM_SPARSE)]
            self.columns = [*DENSE_NAMES, *SPARSE_NAMES]
        else:
            names = [s.name for s in spec.sparse]
            self.columns = sorted(needed_columns(self.spec))
        if sorted(names) != sorted(feature_names):
            raise ValueError(f"the spec's sparse features {names} are not the model's {list(feature_names)}")
        self._names = names
        self._order = [names.index(f) for f in feature_names]
        self.feature_names = list(feature_names)

    @property
    def dense_names(self) -> list[str]:
        """The dense features in the order of the dense matrix (and of the model's dense input)."""
        if self.spec.format is Format.CRITEO_TSV:
            return list(DENSE_NAMES)
        return [d.name for d in self.spec.dense]

    def encode(
        self, records: Sequence[Mapping[str, Any]]
    ) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """``(dense (N, num_dense) float32, {feature: (ids (nnz,), lengths (N,))})`` of ``records``.

        Raises:
            ValueError: a record that is not a mapping, lacks a column, or has a value the spec's
                parser refuses (the message names the record's index, the field and the value).
        """
        if isinstance(records, Mapping) or not isinstance(records, Sequence):
            raise ValueError(f"records must be a sequence of mappings, got {type(records).__name__}")
        try:
            if self.spec.format is Format.PARQUET:
                table: Table | None = self._arrow(records)
            else:
                data = self._text(records)
                table = None
            issues = Issues(_WHERE, OnError.RAISE)
            if self.spec.format is Format.CRITEO_TSV:
                block = parse_criteo(
                    data, first_line=0, has_label=False, issues=issues, id_spaces=self._spaces()
                )
            else:
                if table is None:
                    fields = split_fields(
                        data,
                        delimiter=_SEP.encode(),
                        num_fields=len(self.columns),
                        first_line=0,
                        issues=issues,
                    )
                    table = TextTable(fields, self.columns)
                problems = Problems(table.num_rows)
                block, _ = to_block(table, self.spec, [], problems)
                problems.resolve(table.lines, issues)
        except MalformedInputError as err:  # "record:<index>: <reason>"
            raise ValueError(f"record {str(err).removeprefix(_WHERE + ':')}") from None
        sparse = {
            self.feature_names[i]: (block.ids[j].values, block.ids[j].lengths)
            for i, j in enumerate(self._order)
        }
        return block.dense, sparse

    def _spaces(self) -> tuple[int, ...]:
        return tuple(self.spec.id_space(s) for s in self.spec.sparse)

    def _text(self, records: Sequence[Mapping[str, Any]]) -> bytes:
        """The records as lines of text, one field per column, as a file would hold them."""
        sep = _CRITEO_SEP if self.spec.format is Format.CRITEO_TSV else _SEP
        lines = []
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise ValueError(
                    f"record {i}: must be a mapping of column to value, got {type(record).__name__}"
                )
            values = []
            for column in self.columns:
                if column not in record:
                    raise ValueError(f"record {i}: no column {column!r} (the model needs {self.columns})")
                values.append(_text(record[column], i, column, sep))
            lines.append(sep.join(values))
        return "".join(line + "\n" for line in lines).encode("utf-8")

    def _arrow(self, records: Sequence[Mapping[str, Any]]) -> Table:
        try:
            import pyarrow as pa
        except ImportError:
            raise ValueError("this model was trained on Parquet data: raw records need pyarrow") from None
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise ValueError(
                    f"record {i}: must be a mapping of column to value, got {type(record).__name__}"
                )
            missing = [c for c in self.columns if c not in record]
            if missing:
                raise ValueError(f"record {i}: no column {missing[0]!r} (the model needs {self.columns})")
        try:
            batch = pa.RecordBatch.from_pylist([{c: r[c] for c in self.columns} for r in records])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise ValueError(f"records: a column mixes types ({err})") from None
        table = ArrowTable(batch, -1)  # lines are record indices, as for text
        return table


def _text(value: Any, index: int, column: str, sep: str) -> str:
    """A record's value as the text of its field."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float | np.integer | np.floating):
        raise ValueError(
            f"record {index}: field {column!r} must be text or a number, got {type(value).__name__}"
        )
    if isinstance(value, float | np.floating):
        if not math.isfinite(value):
            raise ValueError(f"record {index}: field {column!r}: not a finite number: {value!r}")
        return repr(float(value))
    text = str(value)
    if any(c in text for c in (sep, "\n", "\r")):
        raise ValueError(f"record {index}: field {column!r} holds a line break or {sep!r}: {text[:40]!r}")
    return text
