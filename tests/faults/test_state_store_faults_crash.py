"""A half-written state store and interrupted loads (issue 57) never change an answer: the worker SIGKILLed
while its writer holds a temporary file (the restart removes it and reads only whole entries);
write-through entries surviving a SIGKILL of the whole server; clients leaving while their prefixes load
(no slot or lock left behind). The filled store and its references: tests/faults/conftest.py."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest

from tests.e2e.server import DETERMINISTIC, Server, running_server
from tests.e2e.test_state_store import answers, load_counts, store_args
from tests.faults.state_store_helpers import (
    BIG_BLOCK,
    BIG_NEW,
    Filled,
    assert_alive,
    entry_files,
    read_whole,
    temp_files,
)
from tests.faults.test_process_death import find_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


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
