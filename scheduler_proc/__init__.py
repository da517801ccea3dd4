"""Scheduler process: request table, hybrid radix cache, slot allocators, admission and retry policy.

Pure CPU bookkeeping (no tensors, no torch). `scheduler.Scheduler` is the logic the process's event loop
(`process.py`) drives; every other module here is one resource or one policy it owns.
"""
