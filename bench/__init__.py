"""hpcdl's benchmarks: figures, not tests (bench/README.md says what each suite measures).

Run from the repository's top as modules: ``python -m bench`` (`make bench`'s table, the same as
``python -m bench.run``), ``python -m bench.hybrid_race``, ``python -m bench.exchange_load``, ...
:mod:`bench.harness` is what they share; :mod:`bench.sections` holds `make bench`'s sections.
"""
