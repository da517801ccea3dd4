"""Logging set-up: every record names the process (and TP rank) that wrote it."""

from __future__ import annotations

import logging
import sys


def setup_logging(proc_name: str, level: str = "info") -> None:
    """Configure the root logger of this process. Call once, first thing in a process entry."""
    fmt = f"%(asctime)s [{proc_name} pid=%(process)d] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
