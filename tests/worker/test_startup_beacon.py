"""`StartupBeacon` (worker_proc/startup_beacon.py) over real zmq channels: a starting rank gives word to the
scheduler and to the launcher with its current phase, and says nothing more once stopped."""

from __future__ import annotations

import time

import zmq

from shared.channels import TO_LAUNCHER, WORKER_TO_SCHEDULER, ChannelTimeout, Receiver
from shared.config import ServerArgs
from shared.messages import ProcStarting, WorkerStarting
from worker_proc.startup_beacon import BEACON_INTERVAL_S, StartupBeacon


def test_beacon_gives_word_with_its_phase_until_stopped(tmp_path) -> None:
    args = ServerArgs(run_dir=str(tmp_path))
    ctx = zmq.Context()
    to_scheduler: Receiver = Receiver(ctx, WORKER_TO_SCHEDULER, args)
    to_launcher: Receiver = Receiver(ctx, TO_LAUNCHER, args)
    beacon = StartupBeacon(ctx, args, rank=3)
    try:
        beacon.phase = "loading the model"
        beacon.start()
        word = to_scheduler.recv(int(10_000 * BEACON_INTERVAL_S))
        assert isinstance(word, WorkerStarting)
        assert word.rank == 3 and word.phase == "loading the model" and word.elapsed_s >= BEACON_INTERVAL_S * 0.9
        told = to_launcher.recv(int(10_000 * BEACON_INTERVAL_S))
        assert isinstance(told, ProcStarting) and told.name == args.proc_name("worker", 3)
        beacon.phase = "opening the state store"
        phases = {to_scheduler.recv(int(10_000 * BEACON_INTERVAL_S)).phase for _ in range(2)}
        assert "opening the state store" in phases
        beacon.check_integrity()
    finally:
        beacon.stop()
    beacon.check_integrity()
    sent = beacon.sent
    late = 0
    deadline = time.monotonic() + 3 * BEACON_INTERVAL_S
    while time.monotonic() < deadline:  # at most a word already on its way: the thread is joined
        try:
            to_scheduler.recv(int(1000 * BEACON_INTERVAL_S))
            late += 1
        except ChannelTimeout:
            pass
    assert late <= 1 and beacon.sent == sent
    beacon.stop()  # twice is fine
    to_scheduler.close()
    to_launcher.close()
    ctx.term()
