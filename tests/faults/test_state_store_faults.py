"""A damaged, foreign, read-only or half-written state store (issue 57) never changes an answer: a
server restarted on it serves every request (status 200) with the output it would give without the
damage, stays up, and counts the loads that failed.

A module fixture fills a store once (the built-in model, --enable-deterministic-inference, 32-token
blocks) and computes the references: the greedy tokens of a server without a store, and the tokens
and logprobs of a server with an empty store serving the restart prompts in the same order (what a
server whose stored entries are all unusable must give, bit for bit: a failed load leaves no trace,
the request is then admitted with its memory match alone and computes its prefix with the same cuts).
Each damage test damages a copy of the filled folder, before the server starts (the start-up scan
removes entries whose header is bad; payload damage is found by the load) or while it runs (every
damage is found by the load), and restarts on it; the prefixes it computed instead are written again
and load after /flush_cache.

Also: a read-only store (loads work, writes fail quietly); the worker SIGKILLed while its writer holds
a temporary file (the restart removes it and reads only whole entries); TP=2 with one rank's entries
damaged (the load fails on both ranks); write-through entries surviving a SIGKILL of the whole server;
clients leaving while their prefixes load (no slot or lock left behind)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.state_store import entry_file as ef
from tests.e2e.server import DETERMINISTIC, Server, running_server
from tests.e2e.test_state_store import Prompts, answers, flush_memory, load_counts, make_prompts, outcome, store_args
from tests.faults.test_process_death import find_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

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


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Filled:
    tmp = tmp_path_factory.mktemp("filled")
    prompts = make_prompts(61)
    restart = prompts.restart_prompts
    rng = random.Random(62)
    big = [[rng.randrange(3, 256) for _ in range(BIG_LEN)] for _ in range(6)]
    with running_server([*DETERMINISTIC, *store_args(tmp / "pristine")]) as server:
        answers(server, prompts.fill)
    with running_server([*DETERMINISTIC, "--mamba-ssm-dtype", "int8", *store_args(tmp / "foreign")]) as server:
        answers(server, prompts.fill)
    with running_server(DETERMINISTIC) as server:
        no_store_ids = [r["output_ids"] for r in answers(server, restart)]
        big_ids = [r["output_ids"] for r in answers(server, big, BIG_NEW)]
    with running_server([*DETERMINISTIC, *store_args(tmp / "empty")]) as server:
        empty_store = answers(server, restart)
    assert [r["output_ids"] for r in empty_store] == no_store_ids
    assert namespace_folders(tmp / "pristine")[0].name != namespace_folders(tmp / "foreign")[0].name
    kinds = {kind(f) for f in entry_files(tmp / "pristine")}
    assert kinds == {"kv", "state"}, kinds
    return Filled(prompts, restart, tmp / "pristine", tmp / "foreign", no_store_ids, empty_store, big, big_ids)


def copy_store(filled: Filled, dest: Path) -> Path:
    shutil.copytree(filled.pristine, dest)
    return dest


def damage_all(folder: Path, name: str, foreign: Path) -> int:
    fn, _ = DAMAGE[name]
    files = entry_files(folder)
    for f in files:
        kind_of[f] = kind(f)
    for f in files:
        fn(f, foreign)
    return len(files)


def assert_alive(server: Server) -> None:
    assert server.proc.poll() is None, server.output[-3000:]
    with server.client() as client:
        assert client.get("/health").status_code == 200
    assert "Traceback" not in server.output, server.output[-5000:]


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


# ------------------------------------------------------------------ (e): the worker killed mid-write
def test_worker_killed_while_writing_leaves_no_partial_entry(tmp_path, filled: Filled) -> None:
    """The worker is SIGKILLed while its writer has a temporary file open (stopped first with SIGSTOP to
    look: a stopped writer cannot rename it); the restart removes the temporary file, reads only
    whole entries, and serves the reference outputs."""
    folder = tmp_path / "store"
    args = [*DETERMINISTIC, "--state-cache-dir", str(folder), "--state-cache-block-tokens", str(BIG_BLOCK)]
    prompts = filled.big
    server = Server(args)
    try:
        server.wait_ready()
        worker = find_process(server, "hyssm::worker-tp0")
        caught, deadline = False, time.monotonic() + 120

        def post(p: list[int]) -> int:
            body = {"input_ids": p, "sampling_params": {"max_new_tokens": BIG_NEW, "temperature": 0,
                                                        "ignore_eos": True}}  # fmt: skip
            try:
                with server.client(timeout=120) as client:
                    return client.post("/generate", json=body).status_code
            except httpx.HTTPError:
                return -1

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(post, p) for p in prompts]
            while not caught and time.monotonic() < deadline:
                if temp_files(folder):
                    os.kill(worker, signal.SIGSTOP)
                    time.sleep(0.01)  # the stop has landed; nothing of the worker moves now
                    if temp_files(folder):
                        os.kill(worker, signal.SIGKILL)
                        caught = True
                    else:
                        os.kill(worker, signal.SIGCONT)
                elif all(f.done() for f in futures):
                    break
                else:
                    time.sleep(0.0005)  # leave the 2 cores to the server
            if not caught:
                os.kill(worker, signal.SIGKILL)
            cf.wait(futures, 60)
        server.wait_exit(30)
    finally:
        server.kill_group()
    assert caught, "the writer never had a temporary file open when looked at"
    left = temp_files(folder)
    assert left, "the killed writer's temporary file is gone"
    whole_before = len(entry_files(folder))

    with running_server(args) as server:
        got = [r["output_ids"] for r in answers(server, prompts, BIG_NEW)]
        loads = load_counts(server)
        assert_alive(server)
    assert got == filled.big_ids
    assert loads["failed"] == 0, (loads, server.output[-3000:])
    assert "removed the temporary file" in server.output, server.output[-3000:]
    assert all(not p.exists() for p in left)
    for f in entry_files(folder):
        read_whole(f)
    assert len(entry_files(folder)) >= whole_before


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


# ------------------------------------------------------------------ write-through survives a crash
def test_write_through_entries_survive_sigkill_of_the_whole_server(tmp_path, filled: Filled) -> None:
    """Once the writer has stored the fill prompts' entries (no graceful stop: the whole process group is
    SIGKILLed), a restart loads them all."""
    folder = tmp_path / "store"
    server = Server([*DETERMINISTIC, *store_args(folder)])
    try:
        server.wait_ready()
        answers(server, filled.prompts.fill)
        expected = sorted(p.name for p in entry_files(filled.pristine))
        deadline = time.monotonic() + 30
        while sorted(p.name for p in entry_files(folder)) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.kill_group()
    assert sorted(p.name for p in entry_files(folder)) == expected
    with running_server([*DETERMINISTIC, *store_args(folder)]) as server:
        got = answers(server, filled.restart)
        loads = load_counts(server)
        assert_alive(server)
    assert [r["output_ids"] for r in got] == filled.no_store_ids
    assert loads == {"started": 4, "loaded": 4, "failed": 0}, loads
    assert got[0]["meta_info"]["cached_tokens"] == len(filled.restart[0]) - 1


# ------------------------------------------------------------------ clients gone while their prefixes load
def test_clients_leaving_while_prefixes_load_leave_no_trace(tmp_path, filled: Filled) -> None:
    """Long stored prefixes are being loaded for requests whose clients time out and leave (aborts while
    waiting, loading or running, whichever each one hits): the server stays up, holds no slot and no lock
    for them, and then serves every prompt's reference output."""
    import asyncio

    folder = tmp_path / "store"
    args = [*DETERMINISTIC, "--state-cache-dir", str(folder), "--state-cache-block-tokens", str(BIG_BLOCK)]
    with running_server(args) as server:
        answers(server, filled.big, BIG_NEW)
    with running_server(args) as server:

        async def leave_early() -> list[str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=0.02) as client:

                async def one(p: list[int]) -> str:
                    body = {"input_ids": p, "sampling_params": {"max_new_tokens": BIG_NEW, "temperature": 0,
                                                                "ignore_eos": True}}  # fmt: skip
                    try:
                        await client.post("/generate", json=body)
                        return "answered"
                    except httpx.TimeoutException:
                        return "left"

                return await asyncio.gather(*(one(p) for p in filled.big))

        outcomes = asyncio.run(leave_early())
        # settled when every slot is free or cached (a LOADING request is neither running nor waiting)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with server.client() as client:
                sched = client.get("/get_server_info").json()["scheduler"]["server"]
            if (sched["kv_free"] + sched["kv_cached"] == sched["kv_capacity"]
                    and sched["state_free"] + sched["state_cached"] == sched["state_capacity"]):  # fmt: skip
                break
            time.sleep(0.1)
        aborted = server.metric("hyssm_requests_finished_total", reason="abort")
        got = [r["output_ids"] for r in answers(server, filled.big, BIG_NEW)]
        assert_alive(server)
    assert "left" in outcomes, outcomes
    assert aborted >= 1, (outcomes, server.output[-3000:])
    assert sched["kv_used_by_requests"] == 0 and sched["state_used_by_requests"] == 0, sched
    assert sched["num_locked_nodes"] == 0, sched
    assert sched["kv_free"] + sched["kv_cached"] == sched["kv_capacity"], sched
    assert sched["state_free"] + sched["state_cached"] == sched["state_capacity"], sched
    assert got == filled.big_ids
