"""What the state store fault tests (test_state_store_faults*.py) share: the store's files (namespaces,
entries, temporary files), the filled store and its references (filled by the fixture in conftest.py),
copying it, and the check that a server is still up."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.state_store import entry_file as ef
from tests.e2e.server import Server
from tests.e2e.test_state_store import Prompts

KEY_LEN = 64
BIG_BLOCK = 64  # the killed worker's store: many entries of 64 KiB
BIG_LEN = 3000
BIG_NEW = 4


# ------------------------------------------------------------------ the store's files
def namespace_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir())


def namespace_entries(ns: Path) -> list[Path]:
    """Every entry file (64 hex name in its 2 hex folder) of one namespace folder."""
    return sorted(f for sub in ns.iterdir() if sub.is_dir()
                  for f in sub.iterdir() if len(f.name) == KEY_LEN and f.name[:2] == sub.name)  # fmt: skip


def entry_files(root: Path) -> list[Path]:
    """Every entry file of every namespace under `root`."""
    return [f for ns in namespace_folders(root) for f in namespace_entries(ns)]


def temp_files(root: Path) -> list[Path]:
    out = []
    for ns in namespace_folders(root):
        for sub in ns.iterdir():
            if sub.name.startswith(ef.TMP_PREFIX):
                out.append(sub)
            elif sub.is_dir():
                try:
                    out.extend(f for f in sub.iterdir() if f.name.startswith(ef.TMP_PREFIX))
                except FileNotFoundError:
                    pass
    return out


def read_whole(path: Path) -> ef.StoredEntry:
    """The entry at `path`, checked against its own folder's namespace and its file name."""
    return ef.read_entry(str(path), path.parent.parent.name, path.name)


def kind(path: Path) -> str:
    return json.loads(read_whole(path).meta)["kind"]


# ------------------------------------------------------------------ the filled store and the references
@dataclass
class Filled:
    prompts: Prompts
    restart: list[list[int]]
    pristine: Path  # the store run 1 filled (float32 states)
    foreign: Path  # the same prompts stored by a server with int8 states (another namespace)
    no_store_ids: list[list[int]]  # the restart prompts' greedy tokens without a store
    empty_store: list[dict]  # the restart prompts' answers from a server whose store started empty
    big: list[list[int]]  # long prompts (the worker killed while writing them)
    big_ids: list[list[int]]  # their greedy tokens (BIG_NEW) without a store


def copy_store(filled: Filled, dest: Path) -> Path:
    shutil.copytree(filled.pristine, dest)
    return dest


def assert_alive(server: Server) -> None:
    assert server.proc.poll() is None, server.output[-3000:]
    with server.client() as client:
        assert client.get("/health").status_code == 200
    assert "Traceback" not in server.output, server.output[-5000:]
