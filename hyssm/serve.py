"""One launch on this node, from its command line to its exit code: `hyssm-launch` and
`python launch.py` (launch.py), and `hyssm serve` (hyssm/cli.py).

`main` runs the steps in order, each step's rules living in its own module: the flags become
`ServerArgs` (hyssm/flags.py), a Hub id becomes its local snapshot (shared/hub.py), the checks pass
before anything starts (hyssm/preflight.py), then a fresh run directory (shared/rundir.py) and the
children with their supervision (hyssm/launcher.py) until they stop. The run directory is removed
whatever the outcome.

Node 0 runs the tokenizer (HTTP), the scheduler and its worker ranks (with --dp-size N: N
schedulers, each with its own ranks; shared/replicas.py); other nodes run only their worker ranks.
When a child dies the launch tells the tokenizer, stops the rest and exits non-zero (with replicas,
a death inside one replica stops only that replica while another is up). SIGTERM/SIGINT shut down
gracefully (exit 0), whether they reach this process alone or the whole process group (see
shared/proc.py): the tokenizer drains first (up to --graceful-shutdown-timeout), then the schedulers
and workers stop; a second SIGTERM/SIGINT to this process kills every child at once (exit 1).
"""

from __future__ import annotations

import logging
import signal
import sys

from hyssm.flags import parse_args
from hyssm.launcher import Launcher, free_port
from hyssm.preflight import preflight
from shared.config import ConfigError
from shared.errors import HyssmError
from shared.hub import resolve_model
from shared.log import setup_logging
from shared.proc import FORWARD_SIGNAL
from shared.replicas import dist_addrs
from shared.rundir import RunDir, remove_stale

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Run one launch to its end; the exit code: 0 after a graceful stop, 1 when a child died or
    start-up failed, 2 for bad flags or a failed preflight check (one line on stderr)."""
    try:
        args = parse_args(argv)
    except (ConfigError, ValueError, TypeError) as e:
        print(f"hyssm-launch: error: {e}", file=sys.stderr)
        return 2
    setup_logging(f"launch-node{args.node_rank}", args.log_level)
    try:
        args = resolve_model(args)  # a Hub id becomes its local snapshot: children only see directories
        preflight(args)
    except (ConfigError, HyssmError) as e:
        print(f"hyssm-launch: error: {e}", file=sys.stderr)
        return 2
    stale = remove_stale()
    if stale:
        logger.info("removed %d run directories left by launches that did not exit: %s", len(stale), stale)
    run = RunDir.create()
    logger.info("run directory %s", run.path)
    addrs = dist_addrs(args, free_port)
    args = args.replace(run_dir=run.path, dist_init_addr=addrs[0] or args.dist_init_addr)
    launcher = Launcher(args)
    for sig in (signal.SIGTERM, signal.SIGINT, FORWARD_SIGNAL):
        signal.signal(sig, launcher.request_stop)
    try:
        launcher.start(addrs)
        info = launcher.wait_ready()
    except HyssmError as e:
        print(f"hyssm-launch: error: {e}", file=sys.stderr)
        launcher.shutdown("")
        run.remove()
        return 1
    if args.node_rank == 0:
        logger.info("pools: %s", {k: v for k, v in info.items() if k.endswith("capacity")})
        print(f"hyssm: serving {args.model_name} at http://{args.host}:{args.port}", flush=True)
    else:
        print(f"hyssm: node {args.node_rank} workers ready", flush=True)
    try:
        return launcher.supervise()
    finally:
        run.remove()

