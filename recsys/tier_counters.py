"""The counters of one rank's store shard, read while the stages run: what :mod:`recsys.tier_metrics`
turns into hit rates, and what ``summary.json`` sums over ranks."""

from __future__ import annotations

import torch

from embedding_store import Tier
from recsys.tier_shard import TierShard

__all__ = ["COUNTERS", "TierCounters"]

# Counter vector per table: device hits/misses (id occurrences), host hits/misses, LMDB rows read,
# rows first initialised, rows written to LMDB, device evictions, rows filled into the device tier.
COUNTERS = (
    "device_hits", "device_misses", "host_hits", "host_misses",
    "ssd_rows_read", "rows_initialised", "ssd_rows_written", "device_evictions", "device_rows_in",
)  # fmt: skip


class TierCounters:
    """The counters of ``shard``'s store (none while it is closed, or when the rank holds no table).

    Args:
        shard: this rank's store shard.
    """

    def __init__(self, shard: TierShard) -> None:
        self.shard = shard

    def counters(self) -> dict[str, torch.Tensor]:
        """Per owned table, the monotonic counters named by ``COUNTERS`` as a float64 vector."""
        store = self.shard.store
        if store is None:
            return {}
        out = {}
        for name, tiers in store.counters().items():  # polled while stages run: no lock wait
            dev, host, ssd = (tiers[t] for t in (Tier.DEVICE, Tier.HOST, Tier.SSD))
            values = [
                dev.hits,
                dev.misses,
                host.hits,
                host.misses,
                ssd.hits,
                ssd.misses,
                ssd.rows_in,
                dev.evictions,
                dev.rows_in,
            ]
            out[name] = torch.tensor(values, dtype=torch.float64)
        return out

    def stats(self) -> dict[str, dict[str, object]]:
        """Per table and tier counters of this rank's store (JSON-ready)."""
        store = self.shard.store
        if store is None:
            return {}
        return {
            name: {tier.value: _stats_dict(s) for tier, s in tiers.items()}
            for name, tiers in store.stats().tables.items()
        }

    @property
    def capacity_rows(self) -> dict[str, dict[str, int]]:
        """What this rank's part of each table runs with: its slot shard's rows and its host rows."""
        config = self.shard.config
        return {
            t.name: {"device_rows": config.device_rows(t), "host_rows": config.host_rows(t)}
            for t in sorted(self.shard.tables, key=lambda t: t.name)
        }


def _stats_dict(stats: object) -> dict[str, object]:
    fields = getattr(stats, "__dataclass_fields__", {})
    return {k: getattr(stats, k) for k in fields}
