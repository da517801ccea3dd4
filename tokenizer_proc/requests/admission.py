"""Admission of generation requests in the HTTP process: the queue limit, the shutdown drain and
the KV-fit check, all decided before a response starts (so a streamed request is refused with a
plain status, never with a 200 and an error event).

Owner: one `Admission` per app (AppContext.admission), used by flow.respond and /health. Rules:
- The count is the HTTP process's own: every choice of a generation request holds a reservation
  in `InFlight` from before its response starts until it ends. One HTTP process fronts every
  replica, so the count covers --dp-size > 1 without asking the schedulers, and it is decided
  synchronously in the event loop, so concurrent requests cannot pass the limit together.
- At most `dp_size * (max_running_requests + max_queued_requests)` choices are admitted at once;
  a request that would go past it gets 503 with `Retry-After: RETRY_AFTER_S`. A request arriving
  when nothing is admitted is always taken (an `n` larger than the limit is still served alone).
- Queue depth = admitted choices beyond the running slots (`dp_size * max_running_requests`).
- From `start_draining` on (SIGTERM) every new generation request gets 503 and /health answers
  503 {"status": "draining"}; requests admitted before go on until they end or the grace is over.
- `refused` counts refusals by reason ("queue_full", "draining") for /metrics and /get_load.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.config import ServerArgs
from shared.messages import SchedulerInfo
from tokenizer_proc.http.errors import bad_request, unavailable
from tokenizer_proc.replicas.backend import ReplicatedBackend
from tokenizer_proc.requests.generation import Backend
from tokenizer_proc.requests.prepare import PreparedRequest

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Retry-After of a refusal: the time a running generation typically frees a slot in, short enough
that a client backing off (the openai SDK honours it) retries while the queue drains."""


@dataclass
class Admission:
    """Queue limit and drain state of one app (module rules)."""

    running_slots: int
    limit: int
    draining: bool = False
    refused: Counter[str] = field(default_factory=Counter)
    kv_capacity: int | None = None  # the smallest replica's KV pool, once a scheduler has told it

    @staticmethod
    def from_args(args: ServerArgs) -> Admission:
        running = args.dp_size * args.max_running_requests
        return Admission(running, running + args.dp_size * args.max_queued_requests)

    def queued(self, admitted: int) -> int:
        return max(0, admitted - self.running_slots)

    def admit(self, admitted: int, wanted: int) -> None:
        """Raise the 503 for `wanted` more choices when `admitted` are in flight (module rules)."""
        if self.draining:
            self.refused["draining"] += 1
            raise unavailable("the server is shutting down; send the request to another server",
                              RETRY_AFTER_S)  # fmt: skip
        if admitted and admitted + wanted > self.limit:
            self.refused["queue_full"] += 1
            raise unavailable(f"the server is at capacity ({admitted} requests in flight, at most {self.limit}: "
                              "--max-running-requests + --max-queued-requests per replica); retry later",
                              RETRY_AFTER_S)  # fmt: skip

    def start_draining(self) -> None:
        self.draining = True

    async def check_fits(self, backend: Backend, reqs: Sequence[PreparedRequest]) -> None:
        """400 for a request whose prompt and max_new_tokens can never fit the KV pool (the
        scheduler would reject it once the response had begun). The pool size is asked once."""
        capacity = await self._capacity(backend)
        if not capacity:
            return
        for r in reqs:
            need = len(r.input_ids) + r.sampling.max_new_tokens - 1
            if need > capacity:
                raise bad_request(
                    f"prompt ({len(r.input_ids)}) + max_new_tokens ({r.sampling.max_new_tokens}) can never fit "
                    f"the KV cache: it needs {need} token slots, the pool has {capacity} (--max-total-tokens)",
                    "max_tokens")  # fmt: skip

    async def _capacity(self, backend: Backend) -> int | None:
        """The KV token slots of the smallest replica (the figure the scheduler validates against);
        None (no check here, the scheduler still rejects) until a scheduler answers."""
        if self.kv_capacity is not None:
            return self.kv_capacity
        # each replica's own answer (not ReplicatedBackend.info: that sums them, and records them)
        sources: list[Backend] = [backend]
        if isinstance(backend, ReplicatedBackend):
            sources = [backend.clients[d] for d in backend.live()]
        answers = await asyncio.gather(*(s.info() for s in sources), return_exceptions=True)
        capacities = []
        for a in answers:
            if isinstance(a, SchedulerInfo) and a.server.kv_capacity > 0:
                capacities.append(a.server.kv_capacity)
            elif not isinstance(a, SchedulerInfo):
                logger.debug("KV capacity not known yet: %r", a)
        if capacities:
            self.kv_capacity = min(capacities)
        return self.kv_capacity
