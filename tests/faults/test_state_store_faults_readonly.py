"""A read-only state store (issue 57): loads work, writes fail quietly; the server restarted on it serves
every request with the output it would give without a store, stays up, and reports the outage once
(the filled store and its references: tests/faults/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_state_store import answers, load_counts, store_args
from tests.faults.state_store_helpers import (
    Filled,
    assert_alive,
    copy_store,
    entry_files,
    namespace_folders,
    temp_files,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


# ------------------------------------------------------------------ (d): a read-only store
def make_read_only(folder: Path) -> str:
    """Make the namespace folder and its subfolders unwritable: chmod 555, or (root ignores modes) the
    immutable attribute; returns how, or skips when neither takes effect."""
    dirs = [ns for ns in namespace_folders(folder)] + [d for ns in namespace_folders(folder) for d in ns.iterdir()
                                                        if d.is_dir()]  # fmt: skip
    for d in dirs:
        d.chmod(0o555)
    if not os.access(dirs[0], os.W_OK):
        return "chmod"
    for d in dirs:
        d.chmod(0o755)
    if shutil.which("chattr") is None:
        pytest.skip("running as root: chmod 555 does not stop writes, and there is no chattr")
    res = subprocess.run(["chattr", "+i", *map(str, dirs)], capture_output=True, text=True)
    probe = dirs[0] / ".probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return "chattr"
    probe.unlink()
    subprocess.run(["chattr", "-i", *map(str, dirs)], capture_output=True)
    pytest.skip(f"running as root: chmod 555 does not stop writes, chattr +i did not either ({res.stderr.strip()})")


def make_writable(folder: Path, how: str) -> None:
    dirs = [ns for ns in namespace_folders(folder)] + [d for ns in namespace_folders(folder) for d in ns.iterdir()
                                                        if d.is_dir()]  # fmt: skip
    if how == "chattr":
        subprocess.run(["chattr", "-i", *map(str, dirs)], check=True, capture_output=True)
    for d in dirs:
        d.chmod(0o755)


def test_read_only_store_serves_its_entries_and_writes_fail_quietly(tmp_path, filled: Filled) -> None:
    folder = copy_store(filled, tmp_path / "store")
    before = sorted(p.name for p in entry_files(folder))
    how = make_read_only(folder)
    try:
        with running_server([*DETERMINISTIC, *store_args(folder)]) as server:
            got = answers(server, filled.restart)
            loads = load_counts(server)
            write_errors = server.metric("hyssm_state_store_errors_total", op="write")
            degraded = server.metric("hyssm_state_store_degraded")
            assert_alive(server)
    finally:
        make_writable(folder, how)
    assert [r["output_ids"] for r in got] == filled.no_store_ids
    assert loads == {"started": 4, "loaded": 4, "failed": 0}, loads  # as run 2 of tests/e2e/test_state_store.py
    assert write_errors >= 1 and degraded == 1, (write_errors, degraded, server.output[-3000:])
    assert "state store write failed" in server.output
    assert server.output.count("state store write failed") == 1  # logged once per outage
    assert sorted(p.name for p in entry_files(folder)) == before
    assert temp_files(folder) == []
