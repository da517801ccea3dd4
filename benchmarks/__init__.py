"""Benchmarks for hyssm: load generators and micro-benchmarks, not tests.

- ``bench_serving.py``: HTTP load generator against a running hyssm
  server (``python benchmarks/bench_serving.py --help``); its metric helpers are unit-tested in
  ``tests/bench/``.
- ``make_bench_model.py``: random-weight checkpoints with real Granite-4.0-H shapes
  (``bench_model_shapes.py``, ``bench_tokenizer.py``).
- ``bench_peers.py``: hyssm vs llama-server vs transformers on one checkpoint, one table
  (``peers_commands.py``, ``peers_procs.py``, ``peers_report.py``, ``peers_transformers.py``, ``peers_gguf.py``).
- ``bench_scheduler.py``: µs per scheduling round, in-process.
"""
