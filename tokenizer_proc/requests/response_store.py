"""`ResponseStore`: the Responses API objects this server keeps (`store: true`, the default), for
`previous_response_id` and GET / DELETE /v1/responses/{id}.

One per app, in memory only (a restart forgets them, as with vLLM's store). At most `capacity`
responses: storing one more drops the least recently stored or used. Each entry is the response object
as answered and the conversation after it: its inputs (without its instructions) and outputs as chat
messages, what a follow-up request continues.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.requests.schemas import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: tuple[ChatMessage, ...]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a response store holds at least one response, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, response: dict[str, Any], conversation: list[ChatMessage]) -> None:
        self._entries[rid] = StoredResponse(response, tuple(conversation))
        self._entries.move_to_end(rid)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        return self._entries.pop(rid, None) is not None

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.capacity, (len(self._entries), self.capacity)
        for rid, entry in self._entries.items():
            assert entry.response["id"] == rid, (rid, entry.response["id"])
