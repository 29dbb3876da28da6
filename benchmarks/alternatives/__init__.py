"""The parts of ``benchmarks/bench_alternatives.py`` (its docstring describes the arms): ``mapped`` puts a
table's weights over a memory-mapped file, ``placement`` folds or indexes ids into in-memory rows and sizes a
table to the machine's memory, ``compare`` summarises repeats and compares arms."""
