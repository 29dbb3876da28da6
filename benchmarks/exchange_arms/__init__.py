"""The parts of ``benchmarks/bench_exchange.py`` (its docstring describes the arms and every key):
``streams`` turns a stream name into a config and its ``--set`` overrides (MovieLens-1M read in time
order), ``runs`` runs one arm through ``recsys train`` (local ranks, or two torchrun "nodes" on this host)
and measures its CPU, ``summary`` sets the arms' repeats against each other."""
