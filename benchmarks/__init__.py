"""Benchmarks for hyssm: load generators and micro-benchmarks, not tests.

- ``bench_serving.py``: HTTP load generator against a running hyssm
  server (``python benchmarks/bench_serving.py --help``); its metric helpers are unit-tested in
  ``tests/bench/``.
- ``make_bench_model.py``: random-weight checkpoints with real Granite-4.0-H shapes
  (``bench_model_shapes.py``, ``bench_tokenizer.py``).
- ``bench_peers.py``: hyssm vs llama-server vs transformers on one checkpoint, one table
  (``peers_commands.py``, ``peers_procs.py``, ``peers_report.py``, ``peers_transformers.py``, ``peers_gguf.py``,
  ``peers_prompts.py``, ``peers_settle.py``: the idle wait before each measured TTFT).
- ``bench_quality.py``: accuracy of quantized weights and state dtypes, and the state round trip
  (``quality_roundtrip.py``: a long generation stored and resumed every block, per state dtype).
Every ``bench_*.py`` and ``soak.py`` runs as ``python -m benchmarks.<name> --help``
(``tests/bench/test_benchmarks_run.py`` runs each, and a tiny run of each).
- ``bench_scheduler.py``: µs per scheduling round, in-process.
"""
