"""A writer process SIGKILLed in the middle of a large put leaves no partial entry: the next instance on
the same root finds only whole entries and removes the temporary file."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from shared.state_store import DirectoryStore
from shared.state_store.entry_file import TMP_PREFIX
from tests.state_store.common import NAMESPACE_FIELDS, PYTHON, ROOT, key, namespace, subprocess_env

PAYLOAD = 200 << 20
WRITER = textwrap.dedent(f"""
    import hashlib, sys
    from shared.state_store import DirectoryStore, StoreNamespace
    store = DirectoryStore(sys.argv[1], 1 << 40, StoreNamespace(**{NAMESPACE_FIELDS!r}))
    payload = bytes({PAYLOAD})
    n = 0
    while True:
        store.put(hashlib.sha256(str(n).encode()).hexdigest(), payload, meta=b"%d" % n)
        n += 1
""")


def temp_files(folder: Path) -> list[Path]:
    return list(folder.glob(f"*/{TMP_PREFIX}*")) if folder.exists() else []


def entry_files(folder: Path) -> list[Path]:
    return [p for p in folder.glob("*/*") if not p.name.startswith(TMP_PREFIX)] if folder.exists() else []


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_put_leaves_no_partial_entry(tmp_path: Path) -> None:
    folder = tmp_path / namespace().digest
    writer = subprocess.Popen([PYTHON, "-c", WRITER, str(tmp_path)], env=subprocess_env(), cwd=ROOT,
                              stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not (entry_files(folder) and temp_files(folder)):  # one put done, the next under way
            assert writer.poll() is None, writer.stderr.read().decode() if writer.stderr else ""
            assert time.monotonic() < deadline, "the writer never started a put"
            time.sleep(0.002)  # polling interval, not synchronisation
        os.kill(writer.pid, signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    store = DirectoryStore(tmp_path, 1 << 40, namespace())
    assert temp_files(folder) == []
    written = {key(n): n for n in range(len(store.keys()) + 2)}
    for k in store.keys():
        entry = store.get(k)
        assert entry is not None and len(entry.payload) == PAYLOAD and entry.meta == b"%d" % written[k]
    store.check_integrity()
    assert store.keys() and sorted(p.name for p in entry_files(folder)) == sorted(store.keys())
