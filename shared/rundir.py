"""The per-launch run directory (where the ipc:// endpoints live), under the temporary directory.

Rule: launch.py creates `hyssm-XXXX/` and holds an exclusive flock on its LOCK_NAME file for as
long as it runs; the kernel drops that lock however launch.py ends, SIGKILL included. Every start
first removes this user's run directories whose lock is free (their launch.py is gone without
cleaning up), so they never pile up. A directory without the lock file is never touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

PREFIX = "hyssm-"
LOCK_NAME = ".launch.lock"


class RunDir:
    """A run directory and the lock that marks its launch.py alive; held by the launch.py that created it."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path = path
        self._fd = lock_fd

    @staticmethod
    def create(parent: str | None = None) -> RunDir:
        """A new locked run directory. A cleaner may take a lock file in the moment between its
        creation and this flock (and remove the directory): then another directory is made."""
        for _ in range(5):
            path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
            lock = os.path.join(path, LOCK_NAME)
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    return RunDir(path, fd)
            except OSError:
                pass
            os.close(fd)
        raise OSError(f"cannot create a locked run directory under {parent or tempfile.gettempdir()}")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_stale(parent: str | None = None) -> list[str]:
    """Remove the run directories under `parent` (default: the temporary directory) that belong to
    this user and whose launch.py is gone (their lock is free). Returns the paths removed."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        try:
            if not (entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False)
                    and entry.stat(follow_symlinks=False).st_uid == uid):  # fmt: skip
                continue
            fd = os.open(os.path.join(entry.path, LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file: not a run directory of this version, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its launch.py is alive
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
        removed.append(entry.path)
    return removed
