"""Process entry of the tokenizer process: `run(args)`.

Order: load the tokenizer, bind the HTTP socket (--host/--port, or the unix socket
`ServerArgs.http_uds` of hyssm.Engine instead), open the scheduler channels, serve with
uvicorn on uvloop, report `ProcReady(name="tokenizer")` to launch.py once listening. A tokenizer
that cannot load or a port in use is reported as `ProcFailed` and the process exits 1.
SIGTERM/SIGINT start the drain (`drain`): the server keeps listening, so that every new generation
request gets a 503 JSON error (with Retry-After) and /health a 503 {"status": "draining"} (routers
stop sending here), while the requests admitted before go on for up to --graceful-shutdown-timeout
seconds; then what is left is aborted at the scheduler with a final "abort" to each client, uvicorn
stops accepting and closes the connections (cancelling whatever is still open CLOSE_S later; a
cancelled request is aborted too), exit 0. Repeated signals change nothing here: launch.py kills
the process on a second SIGTERM to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
from collections.abc import Callable, Iterator

import uvicorn
import uvloop
import zmq
import zmq.asyncio

from shared.channels import TO_LAUNCHER, ChannelTimeout, Sender
from shared.config import ServerArgs
from shared.heap import release_free_heap
from shared.messages import ProcFailed, ProcReady, ToLauncher
from tokenizer_proc.app import create_app
from tokenizer_proc.context import AppContext
from tokenizer_proc.http.protocol import HttpLimits, protocol_class
from tokenizer_proc.replicas.backend import ReplicatedBackend
from tokenizer_proc.replicas.scheduler_client import SchedulerClient
from tokenizer_proc.requests.tokenizer import ChatConventions, TextTokenizer

logger = logging.getLogger(__name__)

CLOSE_S = 3.0  # after the drain: uvicorn's time to send the last frames and close connections
FD_RESERVE = 128  # descriptors kept for sockets other than HTTP connections, files, pipes


class StartupFailed(Exception):
    """Reported to launch.py as ProcFailed; the process exits 1."""


class _Server(uvicorn.Server):
    """uvicorn.Server that reports readiness and leaves signal handling to `run`."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]):
        super().__init__(config)
        self._on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # signals are installed on the loop by _serve
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that 'port in use' is a clear startup failure."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupFailed(f"cannot resolve --host {host!r}: {e}") from e
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise StartupFailed(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.setblocking(False)
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """The listening unix domain socket at `path` (`ServerArgs.http_uds`: hyssm.Engine's private one in
    the run directory, which removes it with the directory), readable by this user only."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise StartupFailed(f"cannot listen on the unix socket {path}: {e.strerror or e}") from e
    sock.setblocking(False)
    return sock


def connection_limit(wanted: int) -> int:
    """`wanted` connections, or fewer when file descriptors would run out first: the soft
    RLIMIT_NOFILE is raised to the hard limit, and FD_RESERVE descriptors stay for everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-file limit from %d: %s", soft, e)
    if soft == resource.RLIM_INFINITY or wanted <= soft - FD_RESERVE:
        return wanted
    limit = max(1, soft - FD_RESERVE)
    logger.warning("--max-connections %d lowered to %d: the open-file limit is %d", wanted, limit, soft)
    return limit


def open_backend(zctx: zmq.asyncio.Context, args: ServerArgs) -> SchedulerClient | ReplicatedBackend:
    """One SchedulerClient, or with --dp-size > 1 one per replica behind a ReplicatedBackend."""
    if args.dp_size == 1:
        return SchedulerClient(zctx, args)
    return ReplicatedBackend([SchedulerClient(zctx, args.replace(dp_rank=d)) for d in range(args.dp_size)])


async def drain(ctx: AppContext, client: SchedulerClient | ReplicatedBackend, server: uvicorn.Server,
                grace_s: float) -> None:  # fmt: skip
    """The SIGTERM drain (module docstring): refuse new generation requests, let the admitted ones
    end for up to `grace_s`, abort what is left (each client gets a final "abort"), then stop uvicorn."""
    ctx.admission.start_draining()
    try:
        await asyncio.wait_for(ctx.in_flight.idle.wait(), grace_s)
        logger.info("every in-flight request has ended; stopping")
    except asyncio.TimeoutError:
        n = client.abort_all("server shutting down")
        logger.info("aborted %d request(s) still running after %g s", n, grace_s)
    server.should_exit = True


def _report(launcher: Sender[ToLauncher], msg: ToLauncher) -> None:
    try:
        launcher.send(msg, timeout_ms=2000)
    except (ChannelTimeout, zmq.ZMQError) as e:
        logger.error("cannot report to launch.py: %s", e)


async def _serve(args: ServerArgs, launcher: Sender[ToLauncher]) -> None:
    try:
        tokenizer = TextTokenizer.from_dir(args.resolved_model_path, chat=ChatConventions.from_args(args))
    except Exception as e:  # noqa: BLE001 - any load failure is a startup failure
        raise StartupFailed(f"cannot load the tokenizer: {e}") from e
    release_free_heap()  # what parsing tokenizer.json freed
    sock = bind_unix_socket(args.http_uds) if args.http_uds else bind_socket(args.host, args.port)
    zctx = zmq.asyncio.Context()
    try:
        try:
            client = open_backend(zctx, args)
        except zmq.ZMQError as e:
            raise StartupFailed(f"cannot open the scheduler channels: {e}") from e
        client.start()
        try:
            await _serve_http(args, client, tokenizer, sock, launcher)
        finally:
            await client.close()
    finally:
        sock.close()
        zctx.destroy(linger=0)
    logger.info("tokenizer process stopped")


async def _serve_http(
    args: ServerArgs, client: SchedulerClient | ReplicatedBackend, tokenizer: TextTokenizer, sock: socket.socket,
    launcher: Sender[ToLauncher],
) -> None:
    limits = HttpLimits(read_timeout_s=args.http_read_timeout, max_connections=connection_limit(args.max_connections),
                        max_body_bytes=args.max_body_bytes)  # fmt: skip
    app = create_app(args, client, tokenizer)
    config = uvicorn.Config(
        app, loop="uvloop", lifespan="off", access_log=False, ws="none",
        log_config=None, timeout_graceful_shutdown=CLOSE_S, timeout_keep_alive=args.http_keep_alive_timeout,
        http=protocol_class(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
    )
    ready = ProcReady(name="tokenizer", info={"host": args.host, "port": args.port})
    server = _Server(config, lambda: _report(launcher, ready))
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task[None]] = []

    def stop(sig: signal.Signals) -> None:
        if draining or server.should_exit:  # launch.py's own SIGTERM follows a group signal
            return
        logger.info("received %s: draining in-flight requests (at most %g s)", sig.name, args.graceful_shutdown_timeout)
        draining.append(loop.create_task(drain(app.state.ctx, client, server, args.graceful_shutdown_timeout)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    await server.serve(sockets=[sock])
    if not server.started:
        raise StartupFailed(f"the HTTP server did not start on {args.host}:{args.port}")
    # requests cancelled at the end of uvicorn's grace period abort at the scheduler on their way out
    if server.server_state.tasks:
        await asyncio.wait(set(server.server_state.tasks), timeout=1.0)


def run(args: ServerArgs) -> None:
    """Serve the HTTP API until SIGTERM (exit 0); on a startup failure report and exit 1."""
    zctx = zmq.Context()
    launcher: Sender[ToLauncher] = Sender(zctx, TO_LAUNCHER, args)
    try:
        uvloop.run(_serve(args, launcher))
    except StartupFailed as e:
        logger.error("%s", e)
        _report(launcher, ProcFailed(name="tokenizer", error=str(e).splitlines()[0]))
        raise SystemExit(1) from e
    finally:
        launcher.close(linger_ms=2000)  # a ProcFailed sent just before exiting must still arrive
        zctx.term()
