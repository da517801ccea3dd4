"""Reading a checkpoint's safetensors into a built model: which files hold which tensors
(`weight_files`) and `load_weights`, which fills every parameter of a `HybridForCausalLM` from them.

Every failure is a `ModelLoadError` whose message names the file or the tensor at fault. A checkpoint
name becomes a parameter name through the family's `renames` (HybridConfig); names under its
`ignored_prefixes` (e.g. MTP layers) are skipped with one log line; per-expert tensors
`<...>.experts.<j>.<proj>.weight` fill row j of the stacked parameter `<...>.experts.<proj>`. Under
tensor parallelism each rank reads only its slice of every tensor (`safe_open(...).get_slice`), as
the model's `shard_spec` names it. Used by worker_proc.loading.checkpoint (dense checkpoints) and
worker_proc.loading.prequantized (the dense parts of a quantized one).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from shared.errors import ModelLoadError
from worker_proc.model.hybrid import HybridForCausalLM
from worker_proc.model.tp import ShardSpec

logger = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
_PROGRESS_MIN_BYTES = 256 * 2**20
MAPPED_BYTES = 64 * 2**20
"""The most tensor bytes of a checkpoint file mapped at once while loading. Every page a mapping has
touched counts in the worker's resident memory until the mapping closes, on top of the parameters that
hold the values copied out of it: one mapping of a whole file made the load's peak the file's size
above the loaded model."""
_DTYPE_BITS = {"F64": 64, "I64": 64, "U64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16, "I16": 16,
               "U16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "I8": 8, "U8": 8, "BOOL": 8}


def weight_files(model_dir: str) -> dict[str, list[str]]:
    """{file path: [tensor names]} from model.safetensors.index.json, else the single model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from e
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(model_dir, shard), []).append(name)
        for path in files:
            if not os.path.isfile(path):
                raise ModelLoadError(f"missing shard {path} (listed in {index})")
        return files
    if not os.path.isfile(single):
        raise ModelLoadError(f"missing {single} (and no model.safetensors.index.json in {model_dir})")
    return {single: []}


def _read(f: Any, key: str, spec: ShardSpec | None) -> tuple[torch.Tensor, float]:
    """The tensor `key` of an open safetensors file, only the ranges of `spec` read from disk,
    and the fraction of the stored tensor that is (for the progress bar)."""
    if spec is None:
        return f.get_tensor(key), 1.0
    sl = f.get_slice(key)
    lead = (slice(None),) * spec.dim
    parts = [sl[(*lead, slice(a, b))] for a, b in spec.ranges]
    local = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)
    return local, spec.length / max(1, sl.get_shape()[spec.dim])


class _Names:
    """Checkpoint name -> (parameter name, expert row or None); see the module docstring."""

    def __init__(self, model: HybridForCausalLM) -> None:
        self.renames = [(re.compile(p), r) for p, r in model.cfg.renames]
        self.ignored = model.ignored_prefixes
        self.params = dict(model.named_parameters())
        self.skipped = 0  # tensors not loaded (ignored prefixes)

    def resolve(self, raw: str) -> tuple[str, int | None]:
        name = raw
        for pattern, repl in self.renames:
            name = pattern.sub(repl, name)
        m = _PER_EXPERT.match(name)
        if m is not None and name not in self.params:
            stacked = f"{m['base']}.{m['proj']}"
            if stacked in self.params:
                return stacked, int(m["index"])
        return name, None

    def ignore(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.ignored)


class MappedFile:
    """One checkpoint file read through safetensors, its mapping reopened before `MAPPED_BYTES` more of
    tensors would have been read through it (the pages a mapping touched stay resident until it closes).
    Tensors read through an earlier mapping are copies and stay valid."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle: Any = None
        self._mapped = 0

    def handle(self, nbytes: int = 0) -> Any:
        """The open file, reopened first when `nbytes` more would take it past MAPPED_BYTES."""
        if self._handle is None or self._mapped + nbytes > MAPPED_BYTES:
            self._handle = None  # the last reference: the old mapping closes
            self._handle = safe_open(self.path, framework="pt", device="cpu")
            self._mapped = 0
        self._mapped += nbytes
        return self._handle

    def for_tensor(self, key: str) -> Any:
        """The open file to read tensor `key` through (its stored bytes counted against the bound)."""
        return self.handle(stored_bytes(self.handle().get_slice(key)))

    def close(self) -> None:
        self._handle = None


def _iter_tensors(
    files: dict[str, list[str]], names: _Names, spec_of: Callable[[str], ShardSpec | None],
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, str, str, int | None, torch.Tensor, float]]:
    """(file, checkpoint name, parameter name, expert row, this rank's part of the tensor, its
    fraction of the stored tensor); ignored tensors, and those `skip` names, are skipped unread. A
    file is mapped `MAPPED_BYTES` of tensors at a time (`MappedFile`)."""
    for path, listed_names in files.items():
        mapped = MappedFile(path)
        try:
            keys = list(mapped.handle().keys())
            listed = set(listed_names)
            if listed and listed != set(keys):
                missing = sorted(listed - set(keys))
                if missing:
                    raise ModelLoadError(f"{path} lacks tensor {missing[0]!r} listed in the shard index")
            for key in keys:
                if skip is not None and skip(key):
                    continue
                name, row = names.resolve(key)
                if names.ignore(name):
                    names.skipped += 1
                    continue
                spec = spec_of(name)
                if spec is not None and row is not None:  # one expert of a stacked [E, ...] tensor
                    spec = ShardSpec(spec.dim - 1, spec.ranges) if spec.dim > 0 else None
                yield path, key, name, row, *_read(mapped.for_tensor(key), key, spec)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from e
        finally:
            mapped.close()


def stored_bytes(sl: Any) -> int:
    """The bytes a tensor takes in its file, from its safetensors slice (shape and dtype only)."""
    return math.prod(sl.get_shape()) * _DTYPE_BITS.get(sl.get_dtype(), 32) // 8


def load_weights(model: HybridForCausalLM, files: dict[str, list[str]], skip: Callable[[str], bool] | None = None,
                 loaded_elsewhere: frozenset[str] = frozenset()) -> None:
    """Copy every checkpoint tensor into its parameter; raise on a missing, extra or misshapen one.
    Tensors `skip` names are left to the caller, which loads the parameters `loaded_elsewhere`
    (worker_proc.loading.prequantized: the quantized modules)."""
    names = _Names(model)
    params = names.params
    loaded: set[str] = set(loaded_elsewhere)
    rows: dict[str, set[int]] = {}
    total_bytes = sum(os.path.getsize(p) for p in files)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights",
               disable=total_bytes < _PROGRESS_MIN_BYTES)
    with bar:
        for path, raw_name, name, row, local, fraction in _iter_tensors(files, names, model.shard_spec, skip):
            bar.update(int(local.numel() * local.element_size() / fraction))
            if name == "lm_head.weight" and model.lm_head is None:
                continue  # tied head stored anyway: the embedding is the head
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"unexpected tensor {raw_name!r} in {path} (not a parameter of the model)")
            if name in loaded_elsewhere:
                raise ModelLoadError(f"tensor {raw_name!r} in {path}: {name} is stored both quantized and dense")
            target = param if row is None else (param[row] if row < param.shape[0] else None)
            if target is None or tuple(local.shape) != tuple(target.shape):
                want = f"an expert row < {param.shape[0]}" if target is None else tuple(target.shape)
                raise ModelLoadError(f"tensor {raw_name!r} in {path} has shape {tuple(local.shape)}, expected {want}")
            with torch.no_grad():
                target.copy_(local)
            if row is None:
                loaded.add(name)
            else:
                rows.setdefault(name, set()).add(row)
    loaded.update(n for n, got in rows.items() if len(got) == params[n].shape[0])
    missing = sorted(set(params) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"checkpoint lacks tensor {missing[0]!r}{more}")
    if names.skipped:
        logger.info("%d checkpoint tensors under %s not loaded (not used for serving)", names.skipped,
                    ", ".join(model.ignored_prefixes))
