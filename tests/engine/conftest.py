"""Fixtures of the hyssm.Engine tests: a module's engine over the built-in model, a local Hugging Face
Hub cache holding the built-in model under a Hub id, and process checks.

Every engine a test starts is shut down by the test (or its fixture); `process_gone` is how a test
checks that a child of the engine no longer runs (exited and reaped, or a zombie about to be)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hyssm
from shared.config import builtin_model_dir

HUB_ID = "hyssm-test/tiny-hybrid"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ENGINE_ARGS = {"device": "cpu", "random_seed": 0, "enable_deterministic_inference": True}
"""The Engine's arguments matching tests/e2e/server.py's launch (`--device cpu --random-seed 0` + DETERMINISTIC)."""


def process_gone(pid: int) -> bool:
    """No live process has `pid` (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Poll until every pid is gone; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if not process_gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def hyssm_command() -> list[str]:
    """The installed `hyssm` console script (`pip install -e .` puts it beside this interpreter)."""
    beside = os.path.join(os.path.dirname(sys.executable), "hyssm")
    path = beside if os.path.isfile(beside) else shutil.which("hyssm")
    if path is None:
        pytest.fail("no `hyssm` console script: pip install -e . installs it (pyproject [project.scripts])")
    return [path]


def hyssm_children() -> list[int]:
    """Live child processes of this process titled `hyssm::...` (an engine's tokenizer, schedulers, workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and title.startswith(b"hyssm::"):
            pids.append(int(entry))
    return pids


def listening_tcp_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (its socket inodes matched against /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def make_hub_cache(root: Path, repo_id: str = HUB_ID, commit: str = COMMIT) -> Path:
    """A Hub cache at `root` holding the built-in model as `repo_id` at `commit` (branch main), in
    huggingface_hub's own layout: blobs named by content hash, snapshot entries linking to them,
    refs/main naming the commit. Returns the snapshot directory."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(builtin_model_dir())):
        src = Path(builtin_model_dir()) / name
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, repo / "blobs" / digest)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / digest)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hub cache (HF_HUB_OFFLINE=1, HF_HUB_CACHE and HF_HOME pointing into tmp_path) with
    the built-in model under HUB_ID; returns the cache directory. No request leaves the machine."""
    cache = tmp_path / "hf" / "hub"
    make_hub_cache(cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def engine() -> Iterator[hyssm.Engine]:
    """One engine over the built-in model for the module, configured as tests/e2e/server.py's server."""
    eng = hyssm.Engine(model_path="builtin", **ENGINE_ARGS)
    try:
        yield eng
    finally:
        eng.shutdown()
