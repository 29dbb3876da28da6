"""How many device slots and host rows each tiered table gets, resolved once per run.

Precedence, per tiered feature: ``store.capacities_from`` (a tune.json) for the features it sized, else
``[store.capacity.<feature>]``, else ``store.device_rows``/``store.host_rows``. The tune wins because its
predicted hit rates, which the run reports beside the measured ones, hold only at its capacities; a
``[store.capacity]`` entry it replaces is named in an info line. Without tiers (``store.tiered = false``)
neither is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from recsys.errors import UserError
from recsys.store_config import StoreSection, TableCapacity, load_tune, rows_of
from recsys.table_names import table_name

__all__ = ["Capacities", "capacity_override", "mismatch_warning"]

TUNE, SECTION, DEFAULT = "store.capacities_from", "store.capacity", "store"


def capacity_override(capacity: dict[str, TableCapacity]) -> str:
    """The ``--set`` argument that sets ``store.capacity`` to these entries (``{}``: none)."""
    parts = []
    for feature, cap in capacity.items():
        values = [
            f"{key}={json.dumps(value)}"  # an int or a size string, both TOML as JSON writes them
            for key, value in (("device", cap.device), ("host", cap.host))
            if value is not None
        ]
        parts.append(f"{feature}={{{', '.join(values)}}}")
    return f"store.capacity={{{', '.join(parts)}}}"


def _rows(c: dict[str, int]) -> str:
    return f"{c['device_rows']:,} device and {c['host_rows']:,} host rows per owner on {c['owners']} owner(s)"


def mismatch_warning(table: str, differ: dict[str, dict[str, int]]) -> str:
    """The warning of a table that runs with other capacities than tune.json predicted its hit rates for
    (``differ``: an entry of :meth:`Capacities.mismatches`)."""
    return (
        f"table {table} runs with {_rows(differ['ran'])} but store.capacities_from's tune.json predicted its "
        f"hit rates for {_rows(differ['tune'])}: its predicted_* rates do not apply to this run (tune-cache "
        "it with the run's --nproc and --set overrides; its apply: line repeats them)"
    )


@dataclass(kw_only=True, frozen=True, slots=True)
class Capacities:
    """Per tiered sparse feature, its tiers' sizes on each owning rank.

    Attributes:
        device_rows: device slots per owner (the slot table's rows on that rank).
        host_rows: host-DRAM rows per owner (0: no host tier).
        predicted: ``predicted_device_hit_rate`` / ``predicted_host_hit_rate`` of the features that
            ``store.capacities_from``'s tune.json sized (empty without one).
        tuned: what tune.json sized those features with: ``device_rows``, ``host_rows`` (per owner) and
            ``owners`` (the ranks that held a part of the table when it was tuned).
        source: the setting each feature's capacities came from: ``store.capacities_from``,
            ``store.capacity`` or ``store`` (``device_rows``/``host_rows``).
        notes: what the run should say about settings it did not use (info lines).
    """

    device_rows: dict[str, int]
    host_rows: dict[str, int]
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    tuned: dict[str, dict[str, int]] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @classmethod
    def resolve(
        cls, store: StoreSection, features: list[str], *, row_bytes: int, slot_row_bytes: int | None = None
    ) -> Capacities:
        """``store.capacities_from``, else ``[store.capacity]``, else ``store.device_rows``/``host_rows``
        for each tiered feature; tune.json is read here and only here. Without tiers nothing is read.
        Sizes are counted in rows of ``row_bytes`` (host) and ``slot_row_bytes`` (device; default the same).

        Raises:
            UserError: a capacity names a feature that is not tiered, is out of range, or tune.json
                does not load.
        """
        if not store.tiered:
            unused = [f"[store.capacity] ({', '.join(store.capacity)})"] if store.capacity else []
            unused += [f"store.capacities_from ({store.capacities_from})"] if store.capacities_from else []
            notes = (
                (f"store.tiered=false: every table is in memory; {' and '.join(unused)} not used",)
                if unused
                else ()
            )
            return cls(device_rows={}, host_rows={}, notes=notes)
        unknown = sorted(set(store.capacity) - set(features))
        if unknown:
            kept = {f: c for f, c in store.capacity.items() if f in features}
            drop = f"drop their entries: --set '{capacity_override(kept)}'"
            if not store.tables:  # every feature is tiered: these are not features at all
                raise UserError(
                    f"store.capacity names features the data does not have: {unknown}; features: {features}. "
                    f"Correct the names, or {drop}"
                )
            raise UserError(
                f"store.capacity names features that are not tiered: {unknown}; tiered: {features}. Add them "
                f"to store.tables, or {drop}"
            )
        tuned = load_tune(store.capacities_from) if store.capacities_from else {}
        device_rows, host_rows, source, notes = {}, {}, {}, []
        slot_bytes = row_bytes if slot_row_bytes is None else slot_row_bytes
        for f in features:
            device, host, source[f] = store.device_rows, store.host_rows, DEFAULT
            cap = store.capacity.get(f)
            if cap is not None:
                device = device if cap.device is None else rows_of(cap.device, slot_bytes)
                host = host if cap.host is None else rows_of(cap.host, row_bytes)
                source[f] = SECTION
            if f in tuned:
                device, host = int(tuned[f]["device_rows"]), int(tuned[f]["host_rows"])  # type: ignore[call-overload]
                if cap is not None:
                    notes.append(
                        f"store.capacity.{f} is not used: store.capacities_from sizes t_{f} "
                        f"({device:,} device and {host:,} host rows per owner)"
                    )
                source[f] = TUNE
            if device < 1:
                where = (
                    f"{table_name(f)}'s device_rows in {TUNE}"
                    if source[f] == TUNE
                    else f"store.capacity.{f}.device"
                )
                value = cap.device if cap and source[f] == SECTION else device
                raise UserError(f"{where} = {value!r} is less than one row ({slot_bytes} bytes each)")
            device_rows[f], host_rows[f] = device, host
        keys = ("predicted_device_hit_rate", "predicted_host_hit_rate")
        covered = {f: entry for f, entry in tuned.items() if f in device_rows}
        predicted = {f: {k: float(e[k]) for k in keys if k in e} for f, e in covered.items()}  # type: ignore[arg-type]
        sized = {
            f: {
                "device_rows": int(e["device_rows"]),  # type: ignore[call-overload]
                "host_rows": int(e["host_rows"]),  # type: ignore[call-overload]
                "owners": int(e.get("owners", 1)),  # type: ignore[call-overload]
            }
            for f, e in covered.items()
        }
        return cls(
            device_rows=device_rows,
            host_rows=host_rows,
            predicted=predicted,
            tuned=sized,
            source=source,
            notes=tuple(notes),
        )

    def of(self, feature: str) -> tuple[int, int]:
        """``(device_rows, host_rows)`` of one tiered feature."""
        return self.device_rows[feature], self.host_rows[feature]

    def device_key(self, feature: str) -> str:
        """The setting to raise for more device slots of ``feature``."""
        if self.source.get(feature) == TUNE:
            return f"the device_rows of t_{feature} in store.capacities_from's tune.json"
        return f"store.capacity.{feature}.device"

    def mismatches(self, ran: dict[str, dict[str, int]]) -> dict[str, dict[str, dict[str, int]]]:
        """Per tiered table (``t_<feature>``) that tune.json sized, ``{"ran": ..., "tune": ...}`` where the
        capacities it ran with (``ran[table]``: ``device_rows``, ``host_rows``, ``owners``) are not the
        tune's; empty when they agree."""
        out = {}
        for feature, tune in sorted(self.tuned.items()):
            table = table_name(feature)
            if table in ran and ran[table] != tune:
                out[table] = {"ran": dict(ran[table]), "tune": dict(tune)}
        return out
