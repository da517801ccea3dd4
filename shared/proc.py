"""Child-process bootstrap used by launch.py: name the process, set up logging, die with the parent.

Every child is a fresh interpreter (shared/child_process.py) that enters through `child_main`, which
resolves the process kind to its package's entry function. Only this module knows that mapping.

Stop signals: launch.py stops its children in order (tokenizer first, with SIGTERM, so that clients
get their answers; then the scheduler and the workers with STOP_SIGNAL). A SIGTERM that reaches a
scheduler or worker process from anywhere else (the whole process group from systemd, Kubernetes
or `kill -- -PGID`, or a kill of that one process) is passed on to launch.py (as FORWARD_SIGNAL),
which then runs that same ordered shutdown, and the process keeps serving until launch.py stops it.
SIGINT (Ctrl-C reaches the whole group) is left to launch.py likewise. The shutdown begins with the
tokenizer's drain (--graceful-shutdown-timeout); a second SIGTERM or SIGINT to launch.py kills
every process at once.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import traceback

import zmq

from shared.channels import TO_LAUNCHER, Sender
from shared.config import ServerArgs
from shared.log import setup_logging
from shared.messages import ProcFailed

logger = logging.getLogger(__name__)

_ENTRIES = {
    "tokenizer": "tokenizer_proc",
    "scheduler": "scheduler_proc.process",
    "worker": "worker_proc.entry",
}
_PR_SET_PDEATHSIG = 1

STOP_SIGNAL = signal.SIGUSR1
"""How launch.py stops a scheduler or worker process (see the module docstring)."""

FORWARD_SIGNAL = signal.SIGUSR2
"""How a scheduler or worker passes a SIGTERM on to launch.py. A signal of its own, so that launch.py
tells a group SIGTERM (which it also gets from each of these processes) from a second SIGTERM sent
to it, which ends the shutdown's grace period at once."""


def set_parent_death_signal(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux). Elsewhere: a watcher
    thread polls the parent pid and exits the process when it changes. `parent`: the pid that
    started this process; when it is no longer the parent (it died before this ran) the process
    exits at once, as the death signal would have made it."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            return
        except OSError:
            pass

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def process_title(args: ServerArgs, kind: str, rank: int | None) -> str:
    return f"hyssm::{args.proc_name(kind, rank)}"


def _forward_sigterm_to(launcher_pid: int) -> None:
    def forward(signum: int, _frame: object) -> None:
        if os.getppid() == launcher_pid:  # else the launcher is gone and this process dies with it
            logger.info("SIGTERM: passed on to launch.py, which stops every process in order")
            os.kill(launcher_pid, FORWARD_SIGNAL)

    signal.signal(signal.SIGTERM, forward)


def child_main(kind: str, args_bytes: bytes, rank: int | None = None, parent: int | None = None) -> None:
    """Entry of every child process (shared.child_process.BOOTSTRAP); `parent`: the launcher's pid."""
    args = ServerArgs.from_bytes(args_bytes)
    title = process_title(args, kind, rank)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - setproctitle is a dependency
        pass
    set_parent_death_signal(parent=parent)
    setup_logging(title.removeprefix("hyssm::"), args.log_level)
    # launch.py handles Ctrl-C for the whole group; children shut down when told or killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if kind != "tokenizer":  # the tokenizer's own SIGTERM handling is its graceful stop
        _forward_sigterm_to(os.getppid())
    module = importlib.import_module(_ENTRIES[kind])
    try:
        if rank is None:
            module.run(args)
        else:
            module.run(args, rank)
    except Exception as e:  # report the reason to the launcher in one line, then die
        logger.error("%s failed: %s\n%s", title, e, traceback.format_exc())
        report_failure(args, title.removeprefix("hyssm::"), f"{type(e).__name__}: {e}")
        os._exit(1)


def report_failure(args: ServerArgs, name: str, error: str) -> None:
    """Best effort: tell launch.py why this process is about to exit."""
    ctx = zmq.Context.instance()
    try:
        sender = Sender(ctx, TO_LAUNCHER, args)
        sender.send(ProcFailed(name=name, error=error.splitlines()[0] if error else "unknown"), 1000)
        sender.close(linger_ms=1000)
    except Exception:  # noqa: BLE001 - the launcher may be gone already
        pass
