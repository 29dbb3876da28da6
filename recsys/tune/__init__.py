"""Cache tuning: replay a run's id stream, compute hit-rate curves, recommend tier capacities.

Modules: :mod:`~recsys.tune.trace` (per-batch id traces of one store shard, the batch-level cache
simulator of the store's policies plus Belady's optimum, spatial sampling), :mod:`~recsys.tune.curves`
(exact LRU stack distances, curves on a grid), :mod:`~recsys.tune.split` (the budget split),
:mod:`~recsys.tune.replay` (the training run's id stream, routed to owners), :mod:`~recsys.tune.tuner`
(``recsys tune-cache``) and :mod:`~recsys.tune.report` (tune.json, tune.md, plots).

Example:
    >>> from recsys.config import load_config
    >>> from recsys.tune.tuner import tune
    >>> result = tune(load_config("configs/quickstart.toml"), device_budget=2 << 20, host_budget=2 << 20)
    >>> result.doc["tables"]["t_cat_0"]["device_rows"]
"""
