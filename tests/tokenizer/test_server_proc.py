"""The tokenizer process itself (`tokenizer_proc.run`) in a subprocess, with this test playing
launch.py and the scheduler over the real channels: ready report, serving, SchedulerDead,
SIGTERM (exit 0, in-flight requests aborted), and start-up failures (ProcFailed, exit 1)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
import pytest
import zmq

from shared.channels import (
    SCHEDULER_TO_TOKENIZER,
    TO_LAUNCHER,
    TOKENIZER_TO_SCHEDULER,
    ChannelTimeout,
    Receiver,
    Sender,
)
from shared.config import ServerArgs
from shared.messages import (
    AbortReq,
    GenerateReq,
    GetInfoReq,
    InfoResp,
    LoopInfo,
    MetricRecord,
    ProcFailed,
    ProcReady,
    SchedulerDead,
    SchedulerInfo,
    ServerState,
    TokenOut,
    TokenOutBatch,
)

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = (
    "import sys; from shared.config import ServerArgs; from shared.log import setup_logging; "
    "from tokenizer_proc import run; setup_logging('tokenizer', 'info'); "
    "run(ServerArgs.from_bytes(bytes.fromhex(sys.argv[1])))"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GRACE_S = 1.0  # --graceful-shutdown-timeout of these processes: the abort path is what is tested here
INFO = SchedulerInfo(
    server=ServerState(num_running=1, kv_capacity=4096, batch_is_full=True, schedule_policy="fcfs"),
    metrics=[MetricRecord(name="hyssm_admission_refusals_total", type="counter", help="refusals",
                          labels={"reason": "kv"}, value=3)],
    in_flight_step=5, loop=LoopInfo(steps=4, worker_ms_mean=1.5),
)  # fmt: skip


class FakeScheduler:
    """Answers GenerateReq with "ok" (unless the prompt's first id is 0: held forever), InfoResp
    to GetInfoReq, records AbortReqs. Runs in a thread until stopped."""

    def __init__(self, ctx: zmq.Context, args: ServerArgs):
        self.rx = Receiver(ctx, TOKENIZER_TO_SCHEDULER, args)
        self.tx = Sender(ctx, SCHEDULER_TO_TOKENIZER, args)
        self.aborts: list[AbortReq] = []
        self.held = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                msg = self.rx.recv(50)
            except ChannelTimeout:
                continue
            if isinstance(msg, GenerateReq) and msg.input_ids[0] == 0:
                self.tx.send(TokenOutBatch(outs=[TokenOut(rid=msg.rid, token_ids=[ord("x")])]))
                self.held.set()
            elif isinstance(msg, GenerateReq):
                outs = [TokenOut(rid=msg.rid, token_ids=list(b"ok"), finished=True, finish_reason="length",
                                 prompt_tokens=len(msg.input_ids), completion_tokens=2)]
                self.tx.send(TokenOutBatch(outs=outs))
            elif isinstance(msg, GetInfoReq):
                self.tx.send(InfoResp(req_id=msg.req_id, info=INFO))
            elif isinstance(msg, AbortReq):
                self.aborts.append(msg)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.rx.close()
        self.tx.close()


@contextmanager
def tokenizer_process(
    model_dir: str, port: int | None = None
) -> Iterator[tuple[subprocess.Popen, Receiver, FakeScheduler, ServerArgs]]:
    with tempfile.TemporaryDirectory(prefix="hyssm-t-") as run_dir:
        args = ServerArgs(model_path=model_dir, port=port or _free_port(), run_dir=run_dir,
                          graceful_shutdown_timeout=GRACE_S)  # fmt: skip
        ctx = zmq.Context()
        launcher = Receiver(ctx, TO_LAUNCHER, args)
        sched = FakeScheduler(ctx, args)
        sched.thread.start()
        proc = subprocess.Popen([sys.executable, "-c", CHILD, args.to_bytes().hex()], cwd=ROOT)
        try:
            yield proc, launcher, sched, args
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            sched.close()
            launcher.close()
            ctx.destroy(linger=0)


def _wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_ready_serve_scheduler_dead_and_sigterm(model_dir: str) -> None:
    with tokenizer_process(model_dir) as (proc, launcher, sched, args):
        ready = launcher.recv(60_000)
        assert ready == ProcReady(name="tokenizer", info={"host": args.host, "port": args.port})
        url = f"http://{args.host}:{args.port}"
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            r = client.post("/generate", json={"text": "hi"})
            assert r.status_code == 200 and r.json()["text"] == "ok", r.text
            assert client.get("/get_server_info").json()["scheduler"] == msgspec.to_builtins(INFO)
            assert 'hyssm_admission_refusals_total{reason="kv"} 3.0' in client.get("/metrics").text
            sched.tx.send(SchedulerDead(reason="scheduler exited unexpectedly (code -9)"))
            _wait_until(lambda: client.get("/health").status_code == 503, 10)
            r = client.post("/generate", json={"text": "hi"})
            assert r.status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_sigterm_aborts_in_flight_streams_and_exits_zero(model_dir: str) -> None:
    with tokenizer_process(model_dir) as (proc, launcher, sched, args):
        assert isinstance(launcher.recv(60_000), ProcReady)
        url = f"http://{args.host}:{args.port}"
        result: dict[str, object] = {}

        def stream() -> None:
            with httpx.Client(base_url=url, timeout=30) as client:
                body = {"input_ids": [0, 1], "stream": True, "sampling_params": {"max_new_tokens": 50}}
                try:
                    with client.stream("POST", "/generate", json=body) as r:
                        result["lines"] = [ln for ln in r.iter_lines() if ln]
                except httpx.HTTPError as e:
                    result["error"] = e

        t = threading.Thread(target=stream)
        t.start()
        assert sched.held.wait(30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 10
        t.join(15)
        assert not t.is_alive()
        # the client got a final answer: an error event (abort), then [DONE]
        lines = result.get("lines")
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]", result
        assert "shutting down" in lines[-2]
        _wait_until(lambda: len(sched.aborts) == 1, 10)
        assert sched.aborts[0].reason == "server shutting down"


def test_port_in_use_is_reported_and_exits_nonzero(model_dir: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with tokenizer_process(model_dir, port=port) as (proc, launcher, _, _args):
            msg = launcher.recv(60_000)
            assert isinstance(msg, ProcFailed) and msg.name == "tokenizer"
            assert str(port) in msg.error and "\n" not in msg.error
            assert proc.wait(15) == 1


def test_unloadable_tokenizer_is_reported(tmp_path) -> None:
    from tests.tokenizer.conftest import write_model_dir

    path = write_model_dir(str(tmp_path / "m"))
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("not a tokenizer")
    with tokenizer_process(path) as (proc, launcher, _, _args):
        msg = launcher.recv(60_000)
        assert isinstance(msg, ProcFailed) and "tokenizer" in msg.error
        assert proc.wait(15) == 1
