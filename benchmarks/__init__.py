"""flatpool benchmarks: ``python -m benchmarks.run`` (``--quick`` for CI, ``--only NAME``)."""
