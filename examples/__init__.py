"""Runnable examples of flatpool, outside the library (not installed with it).

Run them from the repository root: ``./scripts/demo.sh`` (``python -m examples.demo``),
``python -m examples.optim_demo``. :mod:`.launch` starts local ranks with real process groups
(the demos, the tests and the benchmarks use it); :mod:`.hyperparallel_sim` is a simulation of
HyperParallel's HSDP group, the client of ``--client hyperparallel`` and the tests' double.
They are built on flatpool; flatpool never imports them.
"""
