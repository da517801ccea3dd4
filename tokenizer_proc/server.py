"""Process entry of the tokenizer process: `run(args)`.

Order: load the tokenizer, bind the HTTP socket, open the scheduler channels, serve with
uvicorn on uvloop, report `ProcReady(name="tokenizer")` to launch.py once listening. A tokenizer
that cannot load or a port in use is reported as `ProcFailed` and the process exits 1.
SIGTERM/SIGINT: stop accepting, give in-flight requests GRACE_S seconds, then abort the rest at
the scheduler and answer each client with a final "abort" (uvicorn cancels whatever is still
open 2 s later; a cancelled request is aborted too), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from shared.messages import ProcFailed, ProcReady, ToLauncher
from tokenizer_proc.app import create_app
from tokenizer_proc.http.protocol import HttpLimits, protocol_class
from tokenizer_proc.replicas.backend import ReplicatedBackend
from tokenizer_proc.replicas.scheduler_client import SchedulerClient
from tokenizer_proc.requests.tokenizer import ChatConventions, TextTokenizer

logger = logging.getLogger(__name__)

GRACE_S = 3.0
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
    sock = bind_socket(args.host, args.port)
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
    limits = HttpLimits(read_timeout_s=args.http_read_timeout, max_connections=connection_limit(args.max_connections))
    config = uvicorn.Config(
        create_app(args, client, tokenizer), loop="uvloop", lifespan="off", access_log=False,
        log_config=None, timeout_graceful_shutdown=GRACE_S + 2.0, timeout_keep_alive=args.http_keep_alive_timeout,
        http=protocol_class(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
    )
    ready = ProcReady(name="tokenizer", info={"host": args.host, "port": args.port})
    server = _Server(config, lambda: _report(launcher, ready))
    loop = asyncio.get_running_loop()

    def abort_remaining() -> None:
        n = client.abort_all("server shutting down")
        if n:
            logger.info("aborted %d request(s) still running after %.0f s", n, GRACE_S)

    def stop(sig: signal.Signals) -> None:
        if server.should_exit:
            return
        logger.info("received %s: finishing in-flight requests (at most %.0f s)", sig.name, GRACE_S)
        server.should_exit = True
        loop.call_later(GRACE_S, abort_remaining)

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
