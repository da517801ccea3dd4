"""The layouts of the weight copies the tiled products read, defined once: here. The C++ kernels get them as
compiler definitions (`defines`, part of every build's flags and so of its digest; layout.h turns them into
constants), and the Python side that makes the copies (worker_proc.linear.kernels, worker_proc.quant.layouts)
imports them from here.
"""

from __future__ import annotations

TILE_ROWS = 16
"""Output rows of one tiled block: one vector of sixteen float32 (or int32) sums, so an input element is
broadcast into sixteen outputs at once and no sum is reduced across lanes."""
TILE_GROUP = 3
"""Blocks one pass of a tiled product reads side by side (the threads split the blocks in groups of this many)."""
PASS_ROWS = 8
"""Input rows sharing one pass over a weight in the few-row and tiled products (their sums stay in registers)."""
INT8_TILE_COLUMNS = 4
"""Input columns of one output row side by side in an int8 tiled block (one VNNI instruction's four byte pairs)."""
INT4_CHUNK = 8
"""Inputs of one output row in a 64-byte vector of a 4-bit tiled block."""

LAYOUT = {"TILE_ROWS": TILE_ROWS, "TILE_GROUP": TILE_GROUP, "PASS_ROWS": PASS_ROWS,
          "INT8_TILE_COLUMNS": INT8_TILE_COLUMNS, "INT4_CHUNK": INT4_CHUNK}


def defines() -> tuple[str, ...]:
    """The compiler definitions that give the C++ kernels these constants (layout.h)."""
    return tuple(f"-DHYSSM_{name}={value}" for name, value in LAYOUT.items())
