"""A real HTTP server of images on a thread of the test process, for the tokenizer's image URL tests
(test_images_loading.py, test_images_http.py). What it serves: `/a.png` and `/a.jpg` (the fixture image),
`/to-ip` (a redirect to `/a.png` by the server's address), `/never` (held unanswered until the server stops),
`/big-declared` (a body of max_bytes + 1 that says so in Content-Length), `/big-chunked` (twice max_bytes in
chunks, no Content-Length: the limit is found while reading), 404 for every other path."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any

from tests.fixtures.vision_model import image, png_bytes


def encoded(img: Any, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PNG = png_bytes(image(64, 48, seed=1))
JPEG = encoded(image(64, 48, seed=1), "JPEG")


class _Handler(http.server.BaseHTTPRequestHandler):
    release: threading.Event
    max_bytes: int

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        routes = {"/a.png": (PNG, "image/png"), "/a.jpg": (JPEG, "image/jpeg")}
        if self.path in routes:
            body, mime = routes[self.path]
            self.send_response(200)
            self.send_header("Content-Type", mime)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/to-ip":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/a.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/never":
            self.release.wait(60)
        elif self.path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(self.max_bytes + 1))
            self.end_headers()
            self.wfile.write(b"\0" * (self.max_bytes + 1))
        elif self.path == "/big-chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(4):
                chunk = b"\0" * (self.max_bytes // 2)
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def media_server(max_bytes: int) -> Iterator[str]:
    """The server's base URL while the block runs; stopped, its held requests released, when it ends."""
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"release": release, "max_bytes": max_bytes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
