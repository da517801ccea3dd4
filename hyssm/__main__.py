"""`python -m hyssm serve MODEL [flags]` (hyssm/cli.py)."""

from __future__ import annotations

import sys

from hyssm.cli import main

if __name__ == "__main__":
    sys.exit(main())
