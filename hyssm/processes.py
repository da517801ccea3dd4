"""The processes behind one `hyssm.Engine`: the launch's `Launcher` (hyssm/launcher.py), driven from a
supervisor thread.

Owner: `Engine` creates one `Processes` and stops it in `shutdown`. What must hold:
- one thread (`hyssm-supervisor`) starts the children, waits for their readiness and then runs
  `Launcher.supervise` until a child dies or `stop` is asked; it is the parent thread of every child,
  so the kernel's parent-death signal (shared/proc.py) only fires when it ends, which is after the
  children are stopped;
- the first failure (a child dead, a start-up error) is recorded in `failure` and `dead` is set before
  the launcher tells the tokenizer, so a call that sees its request fail can name the reason;
- the run directory (ipc:// endpoints, the tokenizer's unix socket) lives exactly as long as this object;
- a scheduler or worker passes a SIGTERM it gets on to its parent as FORWARD_SIGNAL (shared/proc.py):
  when the engine is created in the main thread and nothing else handles that signal, it stops the
  engine as it stops launch.py (instead of the signal's default action, ending this process); the
  handler is removed again at `stop`.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from hyssm.launcher import Launcher, free_port
from shared.config import ServerArgs
from shared.errors import HyssmError
from shared.proc import FORWARD_SIGNAL
from shared.replicas import dist_addrs
from shared.rundir import RunDir, remove_stale

logger = logging.getLogger(__name__)

SOCKET_NAME = "http.sock"
_JOIN_MARGIN_S = 60.0  # beyond start-up: the ordered stop is bounded (the Launcher's grace periods + SIGKILL)


class _EngineLauncher(Launcher):
    """A Launcher that reports the failure it shuts down for before it tells the tokenizer."""

    def __init__(self, args: ServerArgs, on_failure: Any) -> None:
        super().__init__(args)
        self._on_failure = on_failure

    def shutdown(self, failure: str, *rest: Any, **kw: Any) -> None:
        if failure:
            self._on_failure(failure)
        super().shutdown(failure, *rest, **kw)


class Processes:
    """One launch: run directory, Launcher, supervisor thread (module docstring)."""

    def __init__(self, args: ServerArgs, uds: bool) -> None:
        """`args` already resolved and checked by preflight except for the run directory; with `uds`
        the tokenizer serves on a unix socket in the run directory instead of host:port."""
        stale = remove_stale()
        if stale:
            logger.info("removed %d run directories left by launches that did not exit: %s", len(stale), stale)
        self.run = RunDir.create()
        self.socket_path = f"{self.run.path}/{SOCKET_NAME}" if uds else ""
        self.args = args.replace(run_dir=self.run.path, http_uds=self.socket_path)
        self.failure = ""
        self.dead = threading.Event()
        self.info: dict[str, Any] = {}
        self._ready = threading.Event()
        self._start_error = ""
        self._launcher: _EngineLauncher | None = None
        self._thread: threading.Thread | None = None
        self._handles_forwarded = False

    def start(self) -> None:
        """Start every child and wait until all are ready; EngineError-worthy HyssmError otherwise
        (nothing is left running then)."""
        addrs = dist_addrs(self.args, free_port)
        self.args = self.args.replace(dist_init_addr=addrs[0] or self.args.dist_init_addr)
        self._launcher = _EngineLauncher(self.args, self._fail)
        self._handles_forwarded = (threading.current_thread() is threading.main_thread()
                                   and signal.getsignal(FORWARD_SIGNAL) == signal.SIG_DFL)
        if self._handles_forwarded:
            signal.signal(FORWARD_SIGNAL, self._launcher.request_stop)
        self._thread = threading.Thread(target=self._run, args=(addrs,), name="hyssm-supervisor", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error:
            self._thread.join(_JOIN_MARGIN_S)
            self.run.remove()
            raise HyssmError(self._start_error)

    def _run(self, addrs: list[str]) -> None:
        launcher = self._launcher
        assert launcher is not None
        try:
            launcher.start(addrs)
            self.info = launcher.wait_ready()
        except Exception as e:  # HyssmError, OSError, anything: the caller must not wait forever
            self._start_error = str(e) or type(e).__name__
            self._fail(self._start_error)
            launcher.shutdown("")
            self._ready.set()
            return
        self._ready.set()
        try:
            launcher.supervise()
        finally:
            self._fail("the engine was shut down")

    def _fail(self, failure: str) -> None:
        if not self.dead.is_set():
            self.failure = failure
            self.dead.set()

    @property
    def pids(self) -> dict[str, int]:
        """Each child's name -> pid (the names of ServerArgs.proc_name)."""
        procs = self._launcher.procs if self._launcher is not None else {}
        return {name: p.pid for name, p in procs.items() if p.pid is not None}

    def stop(self) -> None:
        """The launcher's ordered stop (tokenizer first, then schedulers and workers; SIGKILL after its
        grace periods), then the run directory is removed. Idempotent."""
        if self._launcher is not None and self._thread is not None:
            self._launcher.stop_requested = True
            self._thread.join(self.args.startup_timeout + _JOIN_MARGIN_S)
            if self._thread.is_alive():
                logger.error("the engine's processes did not stop in time: %s", self.pids)
        if (self._handles_forwarded and self._launcher is not None
                and threading.current_thread() is threading.main_thread()
                and signal.getsignal(FORWARD_SIGNAL) == self._launcher.request_stop):
            signal.signal(FORWARD_SIGNAL, signal.SIG_DFL)
        self.run.remove()
