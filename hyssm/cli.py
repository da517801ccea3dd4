"""The `hyssm` command (console script, and `python -m hyssm`): `hyssm serve MODEL [flags]`.

`serve` is `launch.py` itself (the same `main`, hyssm/serve.py: its flags, its supervision, its exit
codes): MODEL, a directory, a Hugging Face Hub id or `builtin`, is `--model-path MODEL` and may be left
out (then `--model-path`, else the built-in model).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

USAGE = """usage: hyssm serve [MODEL] [flags]

  MODEL   a checkpoint directory, a Hugging Face Hub id (org/name) or 'builtin' (default)
  flags   those of launch.py: hyssm serve --help lists them
"""


def serve_argv(rest: list[str]) -> list[str]:
    """launch.py's arguments for `hyssm serve REST`: a leading MODEL becomes `--model-path MODEL`."""
    if rest and not rest[0].startswith("-"):
        return ["--model-path", rest[0], *rest[1:]]
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"hyssm: error: unknown command {argv[0]!r} (the command is: serve)", file=sys.stderr)
        return 2
    from hyssm.serve import main as serve  # imported here: `hyssm --help` needs none of the server

    return serve(serve_argv(argv[1:]))
