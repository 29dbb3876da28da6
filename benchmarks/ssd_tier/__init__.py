"""The parts of ``bench_ssd.py``'s write-back measurement: the disk's counters (:mod:`ssd_tier.disk`) and
the measured window into a filled store beside LMDB's own append (:mod:`ssd_tier.writeback`)."""
