"""`ChildProcess`: one process of a launch (tokenizer, scheduler, worker rank), a fresh interpreter.

launch.py's `Launcher` (also under an Engine) owns one per child. The child runs a short bootstrap
(`BOOTSTRAP`) that reads its import path, kind, ServerArgs, rank and the launcher's pid from its
stdin and enters `shared.proc.child_main` (which exits at once if the launcher died meanwhile).
multiprocessing's spawn method is not used: it starts a resource-tracker process beside the launch
for the launch's whole life (a whole interpreter's resident memory, for semaphores and shared memory
hyssm never registers), and it imports the parent's `__main__` into every child (under an Engine,
the user's script with everything it imports).

What must hold, as for `multiprocessing.Process`: `sentinel` (a pidfd) becomes readable when the
child exits; `exitcode` is None until the child has exited, then its exit status, or minus the
signal that ended it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec

BOOTSTRAP = (
    "import sys, msgspec; path, kind, args, rank, parent = msgspec.msgpack.decode(sys.stdin.buffer.read()); "
    "sys.stdin.close(); sys.path[:] = path; from shared.proc import child_main; "
    "child_main(kind, args, rank, parent)"
)


class ChildProcess:
    """One child (see the module doc); `name` names it in the launcher's logs."""

    def __init__(self, kind: str, args: bytes, rank: int | None, name: str) -> None:
        self.kind = kind
        self.name = name
        self._payload = msgspec.msgpack.encode([list(sys.path), kind, args, rank, os.getpid()])
        self._popen: subprocess.Popen[bytes] | None = None
        self._pidfd = -1

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def sentinel(self) -> int:
        if self._pidfd < 0:
            raise ValueError(f"{self.name} is not started")
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def start(self) -> None:
        if self._popen is not None:
            raise RuntimeError(f"{self.name} was started already")
        self._popen = subprocess.Popen([sys.executable, "-c", BOOTSTRAP], stdin=subprocess.PIPE)
        self._pidfd = os.pidfd_open(self._popen.pid)
        assert self._popen.stdin is not None
        try:
            self._popen.stdin.write(self._payload)
            self._popen.stdin.close()
        except BrokenPipeError:  # it died before reading: its exit status says why
            pass

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: for ever) for the child to exit."""
        if self._popen is None:
            return
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            assert self._popen is not None
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            assert self._popen is not None
            self._popen.kill()

    def close(self) -> None:
        """Release the sentinel; the child must have exited."""
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
