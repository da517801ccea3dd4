"""Keys of the state store: what a stored entry depends on (`StoreNamespace`) and the hash chain that
names each full block of a token sequence.

Rules:
- `StoreNamespace.digest` is the sha256 (hex) of the namespace's canonical JSON: an object of all its
  fields by name, keys sorted, separators "," and ":", ASCII only. It depends on nothing else (no
  Python hash seed, no process, no platform), so every process computes the same digest, and any field
  that changes changes it. A new field or a new format changes `FORMAT_VERSION`, which is a field.
- Keys are 32 bytes, written as 64 lowercase hex characters. The root key is
  blake2b-256(person=ROOT_PERSON, data=digest bytes); `block_key(parent, tokens)` is
  blake2b-256(person=BLOCK_PERSON, data=parent key bytes + each token id as an unsigned 32-bit
  little-endian int). A block's key so names the namespace and every token from the sequence's start
  to the block's end: equal keys mean equal prefixes in the same namespace.
- `chain_keys` keys only full blocks; a partial last block has no key. The state after a block is
  stored under `state_key(block key)` = blake2b-256(person=STATE_PERSON, data=block key bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

FORMAT_VERSION = 3
KEY_BYTES = 32
# signed 64-bit, little-endian: every vocabulary id, and an image's key token (< 0, shared/images.py)
TOKEN_FORMAT = "q"
ROOT_PERSON = b"hyssm.root"
BLOCK_PERSON = b"hyssm.block"
STATE_PERSON = b"hyssm.state"
_KEY_RE = re.compile(r"[0-9a-f]{64}")


def canonical_json(value: Any) -> bytes:
    """The one byte encoding of a JSON value that fingerprints are taken over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 (hex) of a model config's canonical JSON (config.json's dict): equal configs, equal prints.
    Infinities and NaNs (a config's `time_step_limit`) are written as JSON5 literals here."""
    text = json.dumps(dict(config), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def check_key(key: object) -> str:
    """The key itself when it is 64 lowercase hex characters; ValueError otherwise."""
    if not is_key(key):
        raise ValueError(f"a store key is 64 lowercase hex characters, got {key!r}")
    return key  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class StoreNamespace:
    """Everything a stored state depends on. Entries of two namespaces never share a key."""

    model_config: str  # config_fingerprint of config.json
    weights: str  # caller-supplied fingerprint of the weights (e.g. the checkpoint's revision or file hashes)
    dtype: str
    quantization: str  # "" for none
    state_dtype: str
    tp_size: int
    tp_rank: int
    adapter_id: str = ""  # "" for none
    numerics: str = ""  # which kernels computed the states ("" for unspecified), e.g. "native+deterministic"
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("model_config", "weights", "dtype", "quantization", "state_dtype", "adapter_id", "numerics"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"StoreNamespace.{name} must be a str")
        for name in ("model_config", "weights", "dtype", "state_dtype"):
            if not getattr(self, name):
                raise ValueError(f"StoreNamespace.{name} must not be empty")
        for name in ("tp_size", "tp_rank", "format_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"StoreNamespace.{name} must be an int")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"StoreNamespace: tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.format_version < 1:
            raise ValueError("StoreNamespace.format_version must be >= 1")

    def chain(self) -> StoreNamespace:
        """The namespace the block keys are computed in: this one at rank 0. Every rank of a TP group
        names a block by the same key (the scheduler computes it once); the rank's own namespace
        (its digest) picks where its slice of the entry lives."""
        return dataclasses.replace(self, tp_rank=0)

    def fields(self) -> dict[str, str | int]:
        return dataclasses.asdict(self)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 (hex) of the canonical JSON of `fields()`."""
        return hashlib.sha256(canonical_json(self.fields())).hexdigest()


def _hash(person: bytes, data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=KEY_BYTES, person=person).hexdigest()


def _pack(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}{TOKEN_FORMAT}", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be 64-bit ints: {e}") from None


def root_key(namespace: StoreNamespace) -> str:
    """The parent key of a sequence's first block."""
    return _hash(ROOT_PERSON, bytes.fromhex(namespace.digest))


def block_key(parent_key: str, tokens: Sequence[int]) -> str:
    """The key of the block `tokens` that follows the block keyed `parent_key` (or the root key)."""
    return _hash(BLOCK_PERSON, bytes.fromhex(check_key(parent_key)) + _pack(tokens))


def state_key(block: str) -> str:
    """The key of the recurrent state after the block keyed `block` (the state that resumes there)."""
    return _hash(STATE_PERSON, bytes.fromhex(check_key(block)))


def chain_keys(namespace: StoreNamespace, tokens: Sequence[int], block_size: int) -> list[str]:
    """The key of every full block of `tokens`, in order."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    packed = _pack(tokens)
    width = struct.calcsize("<" + TOKEN_FORMAT) * block_size
    keys: list[str] = []
    parent = bytes.fromhex(root_key(namespace))
    for start in range(0, len(tokens) // block_size * width, width):
        parent = hashlib.blake2b(parent + packed[start:start + width], digest_size=KEY_BYTES,
                                 person=BLOCK_PERSON).digest()
        keys.append(parent.hex())
    return keys
