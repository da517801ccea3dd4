"""The fused CPU kernels' build cache: a process that dies while building or loading never makes a later
start wait for ever, and a finished build is loaded without the builder."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from worker_proc.kernels import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")

LOAD = "from worker_proc.kernels import native; print(native.load(), native.load_error())"
REPO = Path(__file__).resolve().parents[2]
FULL_BUILD_S = 900
"""A bound on one whole build of the library (every source compiled, on two cores)."""


def _cache_copy(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An XDG cache holding a copy of this machine's finished build."""
    built = native.build_dir()
    target = tmp_path / "cache" / "hyssm" / "kernels" / built.name
    shutil.copytree(built, target, ignore=shutil.ignore_patterns("build.lock"))
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}, target


def _load_in_a_process(env: dict[str, str], timeout_s: float = 120) -> str:
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_builder_lock_left_by_a_killed_process_does_not_block_a_finished_build(tmp_path: Path) -> None:
    env, target = _cache_copy(tmp_path)
    (target / native.BUILDER_LOCK).write_text("")  # what torch's builder leaves when killed inside load()
    assert _load_in_a_process(env) == "True"


@pytest.mark.timeout(FULL_BUILD_S + 120)  # a whole build, past the suite's per-test bound
def test_a_process_killed_while_holding_the_build_lock_does_not_block_the_next(tmp_path: Path) -> None:
    env, target = _cache_copy(tmp_path)
    (target / native.BUILT_MARKER).unlink()
    (target / native.BUILDER_LOCK).write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(target / "build.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert _load_in_a_process(env, FULL_BUILD_S) == "True"  # the build marker is gone: a whole build
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    assert (target / native.BUILT_MARKER).exists() and not (target / native.BUILDER_LOCK).exists()
