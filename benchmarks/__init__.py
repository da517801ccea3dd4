"""Benchmarks for hyssm: load generators and micro-benchmarks, not tests.

- ``bench_serving.py`` (owner: benchmarks/serving): HTTP load generator against a running hyssm
  server (``python benchmarks/bench_serving.py --help``); its metric helpers are unit-tested in
  ``tests/bench/``.
- ``bench_scheduler.py`` (owner: scheduler): µs per scheduling round, in-process.
"""
