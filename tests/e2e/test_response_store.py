"""The Responses API store bounded in bytes (--max-stored-responses-bytes), through a real launch.py: a run
of responses each carrying a large field (a 2 MiB `user`, which is answered and stored but not rendered)
leaves the tokenizer process's resident memory flat once the bound is reached, the most recent response
stays retrievable and continuable, and one dropped for room is a 404."""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.e2e.server import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MIB = 1024 * 1024
BOUND = 8 * MIB  # three or four of the responses below


def _tokenizer(launch_pid: int) -> psutil.Process:
    """The launch's tokenizer process (its title is "hyssm::tokenizer")."""
    for child in psutil.Process(launch_pid).children(recursive=True):
        if " ".join(child.cmdline()).split(" ")[0] == "hyssm::tokenizer":
            return child
    raise LookupError("no hyssm::tokenizer process among the launch's children")


def test_stored_responses_stay_within_their_byte_bound() -> None:
    with running_server(["--max-stored-responses-bytes", str(BOUND)]) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:  # fmt: skip
        proc = _tokenizer(server.proc.pid)
        ids, rss = [], []
        for i in range(60):
            body = {"input": "Hi", "max_output_tokens": 1, "user": chr(ord("a") + i % 26) * (2 * MIB)}
            r = http.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text[:300]
            ids.append(r.json()["id"])
            rss.append(proc.memory_info().rss)
        growth = max(rss[30:]) - max(rss[:15])  # the store is full by then; without the bound, 2 MiB a response
        assert growth < 16 * MIB, [x // MIB for x in rss]
        last = http.get(f"/v1/responses/{ids[-1]}")
        assert last.status_code == 200 and last.json()["user"] == chr(ord("a") + 59 % 26) * (2 * MIB)
        assert http.post("/v1/responses", json={"input": "More", "max_output_tokens": 1,
                                                "previous_response_id": ids[-1]}).status_code == 200  # fmt: skip
        assert http.get(f"/v1/responses/{ids[0]}").status_code == 404
