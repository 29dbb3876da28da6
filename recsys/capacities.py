"""How many device slots and host rows each tiered table gets, resolved once per run."""

from __future__ import annotations

from dataclasses import dataclass, field

from recsys.errors import UserError
from recsys.store_config import StoreSection, load_tune, rows_of

__all__ = ["Capacities"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Capacities:
    """Per tiered sparse feature, its tiers' sizes on each owning rank.

    Attributes:
        device_rows: device slots per owner (the slot table's rows on that rank).
        host_rows: host-DRAM rows per owner (0: no host tier).
        predicted: ``predicted_device_hit_rate`` / ``predicted_host_hit_rate`` of the features that
            ``store.capacities_from``'s tune.json sized (empty without one).
    """

    device_rows: dict[str, int]
    host_rows: dict[str, int]
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def resolve(cls, store: StoreSection, features: list[str], *, row_bytes: int) -> Capacities:
        """``[store.capacity]``, else ``store.capacities_from``, else ``store.device_rows``/``host_rows``
        for each feature; tune.json is read here and only here.

        Raises:
            UserError: a capacity names a feature that is not tiered, is out of range, or tune.json
                does not load.
        """
        unknown = sorted(set(store.capacity) - set(features))
        if unknown:
            raise UserError(
                f"store.capacity names features that are not tiered: {unknown}; tiered: {features}"
            )
        tuned = load_tune(store.capacities_from) if store.capacities_from else {}
        device_rows, host_rows = {}, {}
        for f in features:
            device, host = store.device_rows, store.host_rows
            if f in tuned:
                device, host = int(tuned[f]["device_rows"]), int(tuned[f]["host_rows"])  # type: ignore[call-overload]
            cap = store.capacity.get(f)
            if cap is not None:
                device = device if cap.device is None else rows_of(cap.device, row_bytes)
                host = host if cap.host is None else rows_of(cap.host, row_bytes)
            if device < 1:
                raise UserError(
                    f"store.capacity.{f}.device = {cap.device if cap else device!r} is less than one row "
                    f"({row_bytes} bytes each)"
                )
            device_rows[f], host_rows[f] = device, host
        keys = ("predicted_device_hit_rate", "predicted_host_hit_rate")
        predicted = {
            f: {k: float(entry[k]) for k in keys if k in entry}  # type: ignore[arg-type]
            for f, entry in tuned.items()
            if f in device_rows
        }
        return cls(device_rows=device_rows, host_rows=host_rows, predicted=predicted)

    def of(self, feature: str) -> tuple[int, int]:
        """``(device_rows, host_rows)`` of one tiered feature."""
        return self.device_rows[feature], self.host_rows[feature]
