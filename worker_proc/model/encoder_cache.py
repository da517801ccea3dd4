"""`EncoderCache`: a rank's vision-tower outputs kept by image digest (shared/messages/images.py), so that an
image seen again (a later chunk of the same prompt, another request with the same image) is not encoded
again.

Owned by the model (`HybridForCausalLM.encoder_cache`, sized by `WorkerConfig.encoder_cache_bytes`); every
rank holds its own, and since every rank runs the same steps their contents agree. Rules that hold:
- an entry is the whole image's encoding, [tokens, hidden] in the model dtype; a step reads the rows its
  slices cover;
- bounded in bytes: putting an entry evicts the least recently used ones until the total fits; an
  encoding larger than the whole budget is not kept (the step that made it still uses it);
- `encoded` counts images run through the tower, `hits` images a step found here (one per image per step).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

logger = logging.getLogger(__name__)

DEFAULT_BYTES = 256 << 20


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache budget {max_bytes} bytes < 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.encoded = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> torch.Tensor | None:
        """The encoding of `digest` (counted as a hit, made the most recently used), or None."""
        enc = self._entries.get(digest)
        if enc is not None:
            self._entries.move_to_end(digest)
            self.hits += 1
        return enc

    def put(self, digest: str, encoding: torch.Tensor) -> None:
        """Keep a fresh encoding (counted as encoded), evicting the least recently used entries to fit."""
        self.encoded += 1
        size = encoding.numel() * encoding.element_size()
        old = self._entries.pop(digest, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.numel() * gone.element_size()
        self._entries[digest] = encoding
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def check_integrity(self) -> None:
        held = sum(e.numel() * e.element_size() for e in self._entries.values())
        if held != self.bytes or self.bytes > self.max_bytes:
            raise AssertionError(f"encoder cache holds {held} B, counts {self.bytes} B, budget {self.max_bytes} B")
        bad = [d for d, e in self._entries.items() if e.dim() != 2]
        if bad:
            raise AssertionError(f"encoder cache entry {bad[0]} is not [tokens, hidden]")
