"""A damaged or foreign state store (issue 57) never changes an answer: a server restarted on it serves
every request (status 200) with the output it would give without the damage, stays up, and counts the
loads that failed.

A fixture (tests/faults/conftest.py) fills a store once (the built-in model,
--enable-deterministic-inference, 32-token blocks) and computes the references: the greedy tokens of a
server without a store, and the tokens and logprobs of a server with an empty store serving the restart
prompts in the same order (what a server whose stored entries are all unusable must give, bit for bit: a
failed load leaves no trace, the request is then admitted with its memory match alone and computes its
prefix with the same cuts). Each damage test damages a copy of the filled folder, before the server
starts (the start-up scan removes entries whose header is bad; payload damage is found by the load) or
while it runs (every damage is found by the load), and restarts on it; the prefixes it computed instead
are written again and load after /flush_cache.

Also: TP=2 with one rank's entries damaged (the load fails on both ranks). A read-only store is in
test_state_store_faults_readonly.py; crashes and clients leaving in test_state_store_faults_crash.py."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from shared.state_store import entry_file as ef
from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_state_store import answers, flush_memory, load_counts, outcome, store_args
from tests.faults.state_store_helpers import (
    Filled,
    assert_alive,
    copy_store,
    entry_files,
    kind,
    namespace_entries,
    namespace_folders,
    read_whole,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


# ------------------------------------------------------------------ damage (each on every entry file)
def flip_payload_byte(path: Path, _: Path) -> None:
    header = ef.parse_header(path.read_bytes()[: ef.HEADER_SIZE])
    data = bytearray(path.read_bytes())
    data[ef.HEADER_SIZE + header.meta_len + header.payload_len // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def truncate(path: Path, _: Path) -> None:
    size = path.stat().st_size
    cut = [0, 50, ef.HEADER_SIZE, size // 2, size - 1][int(path.name, 16) % 5]
    os.truncate(path, cut)


def garbage_header(path: Path, _: Path) -> None:
    data = bytearray(path.read_bytes())
    data[: ef.HEADER_SIZE] = random.Random(path.name).randbytes(ef.HEADER_SIZE)
    path.write_bytes(bytes(data))


def foreign_namespace(path: Path, foreign_root: Path) -> None:
    """The file becomes a whole entry of another namespace (a server with int8 states): its header names
    that namespace and that key."""
    same_kind = [f for f in entry_files(foreign_root) if kind(f) == kind_of[path]]
    shutil.copyfile(same_kind[int(path.name, 16) % len(same_kind)], path)


def foreign_layout(path: Path, foreign_root: Path) -> None:
    """A state entry whose header is this namespace's and this key's, checksums right, but whose meta and
    payload are an int8 state's (another layout than the float32 pools'); KV entries stay whole."""
    if kind_of[path] != "state":
        return
    donor = next(f for f in entry_files(foreign_root) if kind(f) == "state")
    entry = read_whole(donor)
    meta, payload = memoryview(entry.meta), memoryview(entry.payload)
    path.write_bytes(ef.pack_header(path.parent.parent.name, path.name, meta, payload) + bytes(meta) + bytes(payload))


kind_of: dict[Path, str] = {}  # each damaged file's kind, read before it was damaged

# damage -> whether the start-up scan finds it (reading headers only) and removes the entry
DAMAGE = {
    "flip_payload_byte": (flip_payload_byte, False),
    "truncate": (truncate, True),
    "garbage_header": (garbage_header, True),
    "foreign_namespace": (foreign_namespace, True),
    "foreign_layout": (foreign_layout, False),
}


def damage_all(folder: Path, name: str, foreign: Path) -> int:
    fn, _ = DAMAGE[name]
    files = entry_files(folder)
    for f in files:
        kind_of[f] = kind(f)
    for f in files:
        fn(f, foreign)
    return len(files)


# ------------------------------------------------------------------ (a) (b) (c): damaged entries
CASES = [(name, when) for name in DAMAGE for when in ("before_start", "while_running")
         if when == "while_running" or name in ("flip_payload_byte", "truncate", "foreign_layout")]  # fmt: skip
"""Before the start, one damage the start-up scan finds (truncate: the others it finds the same way are
unit-tested in tests/state_store) and the two it cannot; while running, every damage (found by the load)."""


@pytest.mark.parametrize(("name", "when"), CASES)
def test_damaged_entries_are_computed_instead(tmp_path, filled: Filled, name: str, when: str) -> None:
    folder = copy_store(filled, tmp_path / "store")
    scan_finds_it = DAMAGE[name][1] and when == "before_start"
    if when == "before_start":
        assert damage_all(folder, name, filled.foreign) > 0
    with running_server([*DETERMINISTIC, *store_args(folder)]) as server:
        if when == "while_running":
            assert damage_all(folder, name, filled.foreign) > 0
        got = answers(server, filled.restart)
        loads = load_counts(server)
        # the prefixes this run computed were written again: with the memory tier empty, the first
        # prompt (x = kB + 1) loads kB of them
        flush_memory(server)
        (healed,) = answers(server, filled.restart[:1])
        after = load_counts(server)
        assert_alive(server)
    for i, (res, want) in enumerate(zip(got, filled.empty_store, strict=True)):
        assert res["output_ids"] == filled.no_store_ids[i], (name, when, i)
        assert outcome(res) == outcome(want), (name, when, i)
        assert res["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"], (name, when, i)
    assert loads["loaded"] == 0, (loads, server.output[-3000:])
    if scan_finds_it:  # removed at start, as the log says: no load is tried
        assert "removed the damaged entry" in server.output, server.output[-3000:]
        assert loads["started"] == 0, loads
    else:  # every load of a stored prefix fails, and the prefix is computed
        assert loads["failed"] == 4, (loads, server.output[-3000:])  # x, y + 1, y, shared[:192] + tail 1
        assert loads["started"] == loads["failed"], loads
    assert after["loaded"] == 1 and after["failed"] == loads["failed"], after
    assert healed["output_ids"] == filled.no_store_ids[0]
    assert healed["meta_info"]["cached_tokens"] == len(filled.restart[0]) - 1
    if scan_finds_it:  # what is left in the folder is whole: what this run wrote again
        for f in entry_files(folder):
            read_whole(f)


# ------------------------------------------------------------------ TP=2: one rank's entries damaged
def rank_folder(root: Path, rank: int) -> Path:
    (folder,) = [ns for ns in namespace_folders(root) if json.loads((ns / "namespace.json").read_text())["tp_rank"]
                 == rank]  # fmt: skip
    return folder


def test_tp2_load_failing_on_one_rank_fails_on_both(tmp_path, filled: Filled) -> None:
    """Only one rank's entries are damaged (rank 0's, then rank 1's): the other rank reads its entries
    whole, yet the load fails on both (agreed across ranks) and both compute the prefix; the answers are
    those of a TP=2 server whose store started empty, bit for bit (the TP=1 references' tokens; their
    logprobs differ in the last bits with the TP size)."""
    filled_tp2 = tmp_path / "filled"
    tp2 = ["--tp-size", "2", *DETERMINISTIC]
    with running_server([*tp2, *store_args(filled_tp2)]) as server:
        answers(server, filled.prompts.fill)
    with running_server([*tp2, *store_args(tmp_path / "empty")]) as server:
        empty_store = answers(server, filled.restart)
    assert [r["output_ids"] for r in empty_store] == filled.no_store_ids
    for rank in (0, 1):
        folder = tmp_path / f"damaged_rank{rank}"
        shutil.copytree(filled_tp2, folder)
        damaged = namespace_entries(rank_folder(folder, rank))
        assert damaged
        for f in damaged:
            flip_payload_byte(f, filled.foreign)
        with running_server([*tp2, *store_args(folder)]) as server:
            got = answers(server, filled.restart)
            loads = load_counts(server)
            assert_alive(server)
        assert loads == {"started": 4, "loaded": 0, "failed": 4}, (rank, loads, server.output[-3000:])
        assert f"worker-tp{rank}" in "".join(ln for ln in server.lines if "removed the damaged entry" in ln)
        assert f"worker-tp{1 - rank}" not in "".join(ln for ln in server.lines if "removed the damaged entry" in ln)
        for i, (res, want) in enumerate(zip(got, empty_store, strict=True)):
            assert outcome(res) == outcome(want), (rank, i)
            assert res["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"], (rank, i)
