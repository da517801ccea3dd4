"""A process of a hyssm.Engine dies: every call waiting on it raises EngineDeadError naming the
failure (no hang), later calls raise at once, and shutdown still leaves no process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest

import hyssm
from tests.engine.conftest import wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}  # runs ~100 s at 50 ms a step
WAITERS = 3
DEADLINE_S = 60.0


def _poll(what: str, ok: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["worker-tp0", "scheduler", "tokenizer"])
def test_a_killed_process_fails_every_waiting_call(victim: str) -> None:
    eng = hyssm.Engine(model_path="builtin", device="cpu", faults={"delay_step_s": 0.05})
    pids = eng.pids
    outcomes: dict[str, BaseException | Any] = {}
    streamed = threading.Event()

    def blocking(i: int) -> None:
        try:
            outcomes[f"generate-{i}"] = eng.generate(f"prompt {i}", LONG)
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            outcomes[f"generate-{i}"] = e

    async def streaming() -> None:
        try:
            async for _ in await eng.async_generate("streamed", LONG, stream=True):
                streamed.set()
            outcomes["stream"] = "ended without an error"
        except BaseException as e:  # noqa: BLE001
            outcomes["stream"] = e

    threads = [threading.Thread(target=blocking, args=(i,), daemon=True) for i in range(WAITERS)]
    threads.append(threading.Thread(target=lambda: asyncio.run(streaming()), daemon=True))
    try:
        for t in threads:
            t.start()
        _poll("the stream's first chunk", streamed.is_set, 60)
        _poll("every request in flight",
              lambda: eng.get_server_info()["tokenizer"]["in_flight_requests"] >= WAITERS + 1, 60)
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"calls still waiting: {sorted(outcomes)}"
        assert sorted(outcomes) == ["generate-0", "generate-1", "generate-2", "stream"]
        for name, outcome in outcomes.items():
            assert isinstance(outcome, hyssm.EngineDeadError), (name, outcome)
            assert "exited unexpectedly" in str(outcome), (name, outcome)
        with pytest.raises(hyssm.EngineDeadError, match="exited unexpectedly"):
            eng.generate("after", {"max_new_tokens": 1})
    finally:
        eng.shutdown()
    assert wait_gone(list(pids.values()), timeout=10.0) == []


def test_a_sigterm_to_a_worker_stops_the_engine_not_this_process() -> None:
    """The worker passes SIGTERM on to its parent (shared/proc.py): the engine's ordered stop runs, as
    launch.py's would, and this process lives on."""
    eng = hyssm.Engine(model_path="builtin", device="cpu")
    pids = eng.pids
    try:
        os.kill(pids["worker-tp0"], signal.SIGTERM)
        assert wait_gone(list(pids.values()), timeout=DEADLINE_S) == []
        with pytest.raises(hyssm.EngineDeadError, match="shut down"):
            eng.generate("after", {"max_new_tokens": 1})
    finally:
        eng.shutdown()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # the engine's handler is gone with it
