"""Benchmarks of buzz_delivery, each figure next to a raw-SQL baseline measured in the same run.

Run ``python -m bench.run`` (``--quick`` for a smoke form, ``--only NAME`` for one scenario).
See ``bench/README.md``. Benchmarks print figures; they never assert timings.
"""
