"""Entry of a worker rank's process (shared/proc.py): the rank's startup beacon speaks before torch
and the model code are imported, so that the scheduler and the launcher hear from it from its first
second (worker_proc/startup_beacon.py); then `worker_proc.process.run` starts and serves."""

from __future__ import annotations

import zmq

from shared.config import ServerArgs
from worker_proc.startup_beacon import StartupBeacon


def run(args: ServerArgs, rank: int) -> None:
    ctx = zmq.Context()
    beacon = StartupBeacon(ctx, args, rank).start()
    try:
        beacon.phase = "importing the runtime"
        from worker_proc import process  # noqa: PLC0415 - imported while the beacon speaks (module doc)
    except BaseException:
        beacon.stop()
        raise
    process.run(args, rank, ctx, beacon)
