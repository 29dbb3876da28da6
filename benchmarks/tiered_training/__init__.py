"""The experiments of ``benchmarks/bench_pipeline.py`` (its docstring describes them): ``runs`` drives a
:class:`~recsys.trainer.Trainer` in this process and measures one fit; ``throughput`` holds fits_cache and
ssd_bound, ``cold``, ``delays`` and ``hit_rates`` one experiment each. Every replaced part of the trainer is
passed in through :class:`~recsys.build.TrainSpec` (subclasses of ``TieredTables``, a feed that keeps its
pipeline, a silent progress bar); nothing of the project is patched.
"""
