"""What an adapter is, as every process refers to it: a PEFT LoRA adapter read and checked once, when it is
registered (`--lora-paths` at start, POST /load_lora_adapter at run time; shared/lora.py `read_adapter`), then
carried by name (GenerateReq.lora), by value to the scheduler (LoadLoraReq) and to the workers when the
scheduler puts it in one of the `--max-loras-per-batch` adapter slots (ForwardBatch.lora_loads). `uid` is the
adapter's identity in every cache: a digest of its files, so an adapter replaced under the same name never
matches the old one's cached prefixes."""

from __future__ import annotations

import msgspec


class LoraAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """A checked adapter. `scaling` is alpha / rank (alpha / sqrt(rank) with rsLoRA); `targets` the model's
    linear layers it changes, in the model's own names (shared/lora.py)."""

    name: str
    path: str
    uid: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
