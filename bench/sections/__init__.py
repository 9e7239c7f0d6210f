"""The sections of `make bench` (bench.run), one module each; each takes the run's
:class:`bench.harness.Bench` and adds its rows (and raw figures under ``b.data``)."""
