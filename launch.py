"""hyssm launcher: `hyssm-launch` (pyproject's console script) and `python launch.py [flags]`.

The top-level entry only: parsing the flags, the checks before anything starts, starting every
process of this node, waiting for their readiness, supervising them and tearing them down are the
hyssm package's (hyssm/serve.py runs the steps; `hyssm serve` is the same `main`).
"""

from __future__ import annotations

import sys

from hyssm.serve import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
