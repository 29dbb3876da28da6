"""The parts of ``benchmarks/bench_stage_cpu.py`` (its docstring describes the measurement): ``driver``
makes the tier stages' calls over one store in the pipeline's order and times them, ``floor`` records
what the store's backend read and wrote and times the same work in raw torch and py-lmdb, and
``trainer`` times the same calls inside a real :class:`~recsys.trainer.Trainer`."""
