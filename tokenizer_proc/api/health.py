"""GET /health: 200 only when the whole pipeline answers (tokenizer -> scheduler -> worker -> back).

Rule: a check sends a one-token generation (like SGLang's /health_generate) and is healthy as soon
as that probe gets its first token, or the scheduler sends any generated token meanwhile (under
load a probe may queue behind other requests, while their tokens show the pipeline works). No
answer within `timeout_s`, a probe that ends without its token (the final error the scheduler
sends every request when its watchdog fires), or a scheduler known to be gone when the probe
ends, is unhealthy (503). Concurrent checks
share one probe, and a probe that is no longer needed is aborted, so a check costs at most one
decode token of work.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from shared.messages import GenerateReq, SamplingParams, TokenOut
from tokenizer_proc.requests.generation import Backend, BackendUnavailable

HEALTH_TIMEOUT_S = 5.0
PROBE_TOKEN = 1  # any id inside the vocabulary


def _failure(out: TokenOut) -> str | None:
    """Why the probe's reply shows no working pipeline: it ended with an error or an abort
    before generating its token (None when it carries a token)."""
    if out.token_ids or not out.finished:
        return None
    if out.finish_reason in ("error", "abort"):
        return f"the probe ended with {out.finish_reason}: {out.error or 'no token generated'}"
    return None


class HealthProbe:
    """The /health check of one app (owns at most one probe task at a time)."""

    def __init__(self, backend: Backend, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._probe: asyncio.Task[str | None] | None = None

    async def check(self) -> str | None:
        """None when healthy, else why not."""
        if not self.backend.healthy:
            return "the scheduler is gone"
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._run(), name="health-probe")
        return await asyncio.shield(self._probe)  # a caller that leaves does not end the probe

    async def settle(self) -> None:
        """Wait for a running probe to end (its request is then no longer running in the scheduler):
        a cache flush is refused while any request runs, and a router probes /health every second."""
        probe = self._probe
        if probe is not None and not probe.done():
            await asyncio.wait({probe})

    async def _run(self) -> str | None:
        rid = f"health-{uuid.uuid4().hex}"
        req = GenerateReq(rid=rid, input_ids=[PROBE_TOKEN],
                          sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))  # fmt: skip
        outs = self.backend.submit(req)
        answered = asyncio.ensure_future(outs.__anext__())
        other = asyncio.ensure_future(self.backend.wait_output())
        try:
            done, _ = await asyncio.wait({answered, other}, timeout=self.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if answered in done and answered.exception() is not None:
                err = answered.exception()
                return f"the scheduler is not available: {err}" if isinstance(err, BackendUnavailable) else repr(err)
            if not done:
                return f"no answer from the scheduler and workers within {self.timeout_s:g} s"
            if answered in done and (failed := _failure(answered.result())) is not None:
                # the probe's final error (the watchdog failing every request as the engine dies)
                # is an answer of a dead pipeline, never a healthy one
                return failed
            return None if self.backend.healthy else "the scheduler is gone"
        finally:
            for t in (answered, other):
                t.cancel()
            await asyncio.gather(answered, other, return_exceptions=True)
            finished = answered.done() and not answered.cancelled() and answered.exception() is None \
                and answered.result().finished  # fmt: skip
            with contextlib.suppress(Exception):
                await outs.aclose()  # type: ignore[attr-defined]
            if not finished:
                self.backend.abort(rid, "health check answered")
