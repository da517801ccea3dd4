"""`ResponseStore`: the Responses API objects this server keeps (`store: true`, the default), for
`previous_response_id` and GET / DELETE /v1/responses/{id}.

One per app, in memory only (a restart forgets them, as with vLLM's store). Bounded twice: at most
`capacity` responses (--max-stored-responses) and at most `max_bytes` in all (--max-stored-responses-bytes);
storing one more drops the least recently stored or used until both bounds hold. An entry's size is
measured once, when it is stored: the length of the msgspec JSON encoding of its response and its
conversation (what its strings cost, whichever field holds them: metadata, user, instructions, tools,
input). A response larger than `max_bytes` by itself is not stored (asking for it later is the usual 404),
and drops nothing. Each entry is the response object as answered and the conversation after it: its
inputs (without its instructions) and outputs as chat messages, what a follow-up request continues.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.config import ServerArgs
from tokenizer_proc.requests.schemas import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: tuple[ChatMessage, ...]
    size: int  # bytes, as measured when stored


def entry_size(response: dict[str, Any], conversation: tuple[ChatMessage, ...]) -> int:
    """What an entry counts against the byte bound: its response and conversation as JSON."""
    return len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int) -> None:
        if capacity < 1 or max_bytes < 1:
            raise ValueError(f"a response store holds at least one response and one byte, got {capacity}, "
                             f"{max_bytes}")  # fmt: skip
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @classmethod
    def from_args(cls, args: ServerArgs) -> ResponseStore:
        return cls(args.max_stored_responses, args.max_stored_responses_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The sizes of the entries kept, together."""
        return self._bytes

    def put(self, rid: str, response: dict[str, Any], conversation: list[ChatMessage]) -> bool:
        """Keep a response (replacing one with its id); False when it alone is over the byte bound."""
        turns = tuple(conversation)
        size = entry_size(response, turns)
        self.delete(rid)
        if size > self.max_bytes:
            return False
        self._entries[rid] = StoredResponse(response, turns, size)
        self._bytes += size
        while len(self._entries) > self.capacity or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.capacity, (len(self._entries), self.capacity)
        assert self._bytes == sum(e.size for e in self._entries.values()) <= self.max_bytes, \
            (self._bytes, self.max_bytes)  # fmt: skip
        for rid, entry in self._entries.items():
            assert entry.response["id"] == rid, (rid, entry.response["id"])
            assert entry.size == entry_size(entry.response, entry.conversation), rid
