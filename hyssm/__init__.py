"""hyssm as a library: `Engine` (hyssm/engine.py) runs the serving processes behind Python calls,
`SamplingParams` (hyssm/sampling.py) holds one request's sampling fields, and the `hyssm serve`
command (hyssm/cli.py) is launch.py. The launch itself lives here too: its flags (flags.py), the
checks before anything starts (preflight.py), the children and their supervision (launcher.py), and
the steps from command line to exit code (serve.py), launch.py being only its script entry. The process
packages (tokenizer_proc, scheduler_proc, worker_proc, shared) stay what they are; this package only
drives them.
"""

from __future__ import annotations

from hyssm.engine import Engine
from hyssm.errors import ConfigError, EngineDeadError, EngineError, RequestError
from hyssm.sampling import SamplingParams

__all__ = ["ConfigError", "Engine", "EngineDeadError", "EngineError", "RequestError", "SamplingParams"]
__version__ = "0.1.0"
