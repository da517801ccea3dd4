"""`LongRequest`: one long /generate in a thread that records how it ended and when, for the tests
that break a server mid-generation (a process killed or hung, a network link taken down)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx


class LongRequest:
    """One 3000-token greedy generation against `url`. `started` is released once the request is
    under way (its first streamed event, or just before a non-streaming POST). `outcome` ends as
    "error-event" (an SSE error event followed by [DONE]), "closed" (any other end of a stream),
    "http-<status>" (with "-without-error-body" when a non-200 body has no "error"), or
    "closed:<exception>"; `ended_at` is time.monotonic() at the end."""

    def __init__(self, url: str, stream: bool, started: threading.Semaphore,
                 input_ids: list[int] | None = None) -> None:
        self.url, self.stream, self.started = url, stream, started
        self.input_ids = input_ids if input_ids is not None else list(range(1, 30))
        self.outcome = ""
        self.ended_at = 0.0

    def __call__(self) -> None:
        body: dict[str, Any] = {"input_ids": self.input_ids, "stream": self.stream,
                                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
        try:
            with httpx.Client(base_url=self.url, timeout=60) as c:
                if self.stream:
                    self._stream(c, body)
                else:
                    self.started.release()
                    r = c.post("/generate", json=body)
                    has_error_body = r.status_code != 200 and "error" in r.json()
                    self.outcome = f"http-{r.status_code}" + ("" if has_error_body else "-without-error-body")
        except httpx.HTTPError as e:
            self.outcome = f"closed:{type(e).__name__}"
        self.ended_at = time.monotonic()

    def _stream(self, c: httpx.Client, body: dict[str, Any]) -> None:
        with c.stream("POST", "/generate", json=body) as r:
            done = False
            for line in r.iter_lines():
                done = done or line == "data: [DONE]"
                if line.startswith("data: ") and '"error"' in line:
                    self.outcome = "error-event"
                elif line.startswith("data: {") and not self.outcome:
                    self.outcome = "streaming"
                    self.started.release()
        if not (self.outcome == "error-event" and done):
            self.outcome = "closed"
