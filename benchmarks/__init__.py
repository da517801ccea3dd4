"""Benchmarks for hyssm: load generators and micro-benchmarks, not tests.

- ``bench_serving.py``: HTTP load generator against a running hyssm
  server (``python benchmarks/bench_serving.py --help``); its metric helpers are unit-tested in
  ``tests/bench/``.
- ``bench_scheduler.py``: µs per scheduling round, in-process.
"""
