"""How the execution plan times a product method on this machine (`ProductTimer`).

A product of few rows reads its whole weight for little arithmetic: its speed is the speed at which
the weight streams from wherever it lives between steps. So it is timed as a decode step meets it:
over the model's own weights in model order, as many as stream at least twice the last-level cache
through (all of them when the model is smaller; then they stay cached, as they do in serving), and
at least one weight of every shape. A
product of more than `STREAM_ROWS` rows reuses each weight row many times and is timed on one weight
per shape, warm. Each figure is the fastest of `reps` rounds after one untimed round (which also
creates oneDNN's primitives and faults in the inputs' and temporaries' pages): interference only ever
adds time. The products run under the process's allocator policy (a worker's steps' policy, as its
steps do), the copies they read each a mapping of its own (`host.memory.blocks_mapped`). A
warm product stops repeating once its rounds took `WARM_BUDGET_S`; a method `HOPELESS` times slower than
the fastest seen at a key stops being timed there after its first warm product (or its untimed one, warm), and
one `HOPELESS` squared slower is not timed at that key's larger row counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.heap import release_free_heap
from worker_proc.host.memory import blocks_mapped
from worker_proc.linear.kernels import COPIES, GemmKernel, TiledWeight
from worker_proc.linear.site import GemmSite
from worker_proc.plan.tuning import DEFAULT_STREAM_BYTES, HOPELESS, STREAM_ROWS, WARM_BUDGET_S
from worker_proc.quant.weight import QuantizedWeight


@dataclass(frozen=True)
class GemmKey:
    """What a product's speed depends on besides its row count: the weight's shape, the activations'
    dtype, the format the weight is stored in (`dense` or a quantized one) and whether it is one expert of
    a stack (whose gathered kernels serve it, and which holds no second copy)."""

    out_features: int
    in_features: int
    dtype: str
    storage: str = "dense"
    experts: bool = False

    @classmethod
    def of(cls, site: GemmSite) -> GemmKey:
        return cls(site.shape[0], site.shape[1], str(site.dtype).removeprefix("torch."), site.storage_format,
                   site.experts)

    def label(self) -> str:
        base = f"{self.out_features}x{self.in_features} {self.dtype}"
        base = base if self.storage == "dense" else f"{base} {self.storage}"
        return f"{base} experts" if self.experts else base


Instance = tuple[GemmSite, torch.Tensor]
Operands = tuple[torch.Tensor, torch.Tensor, object]
"""A product's input rows, its dense weight and what its method reads stored."""
Measure = Callable[[GemmKernel, int, int], dict[GemmKey, float]]
"""(method, rows, threads) -> seconds per product for every key the method supports."""


class ProductTimer:
    """Times methods over a model's product sites (see the module doc); a `Measure`.

    `own_weights_only`: keys the plan reads only as their weights are (under `--single-weight-copy`, a
    shape of a dense weight its owner reads itself, the tied LM head's): methods reading a copy are not
    timed on them, so no copy of those weights is made."""

    def __init__(self, instances: list[Instance], cache_bytes: int, reps: int = 3, max_stream_bytes: int = 0,
                 own_weights_only: frozenset[GemmKey] = frozenset()) -> None:
        budget = 2 * cache_bytes if cache_bytes > 0 else DEFAULT_STREAM_BYTES
        if max_stream_bytes > 0:  # the timing copies of a streamed method (packed or tiled ones) stay within it
            budget = min(budget, max_stream_bytes)
        # in model order until the budget is streamed, then the first weight of each key not yet in it:
        # every key is timed streaming (a weight larger than the budget, the LM head's, must not leave
        # the others untimed, their products then falling back to `dense` at every small row count)
        self.streamed: list[Instance] = []
        streamed_bytes = 0
        streamed_keys: set[GemmKey] = set()
        for site, weight in instances:
            key = GemmKey.of(site)
            if streamed_bytes >= budget and key in streamed_keys:
                continue
            self.streamed.append((site, weight))
            streamed_keys.add(key)
            streamed_bytes += site.weight_bytes(weight)
        self.first: dict[GemmKey, Instance] = {}
        for site, weight in instances:
            self.first.setdefault(GemmKey.of(site), (site, weight))
        self.reps = reps
        self.own_weights_only = own_weights_only
        self.copies: dict[tuple[str, int], object] = {}  # (storage, id(weight)) -> a copy made for timing
        self.quantized_copies: dict[tuple[str, int], QuantizedWeight] = {}  # (kind, id(quantized weight)) -> with it
        self.inputs: dict[tuple[GemmKey, int], torch.Tensor] = {}
        self.fastest: dict[tuple[GemmKey, int, int], float] = {}  # (key, rows, threads) -> seconds per product
        self.beaten: set[tuple[str, GemmKey, int]] = set()  # (method, key, threads) timed no more at larger rows

    def __call__(self, method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        """Seconds per product of `method` at `rows` rows on `threads` threads, per key it is timed on."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        streaming = rows <= STREAM_ROWS
        chosen = self.streamed if streaming else list(self.first.values())
        if method.max_rows and rows > method.max_rows:
            return {}
        chosen = [(s, w) for s, w in chosen
                  if method.supports(s, w.device) and not (s.timed_rows and rows > s.timed_rows)
                  and not (method.reads_copy and GemmKey.of(s) in self.own_weights_only)
                  and (method.name, GemmKey.of(s), threads) not in self.beaten]
        out = self._streamed(method, rows, threads, chosen) if streaming else {}
        for site, weight in [] if streaming else chosen:
            out[GemmKey.of(site)] = self._warm(method, rows, threads, site, weight)
        for key, seconds in out.items():
            best = self.fastest[(key, rows, threads)] = min(seconds, self.fastest.get((key, rows, threads), seconds))
            if seconds > HOPELESS * HOPELESS * best:
                self.beaten.add((method.name, key, threads))
        return out

    def _streamed(self, method: GemmKernel, rows: int, threads: int, chosen: list[Instance]) -> dict[GemmKey, float]:
        """Per key, the fastest of `reps` rounds over its streamed weights (seconds per product), after an
        untimed one; a key's first product is a warm-up, and a later one `_hopeless` ends its timing."""
        samples: dict[GemmKey, list[float]] = {}
        given_up: dict[GemmKey, float] = {}
        calls: dict[GemmKey, int] = {}
        operands = [(GemmKey.of(site), self._operands(method, rows, site, weight)) for site, weight in chosen]
        for rep in range(self.reps + 1):
            spent: dict[GemmKey, list[float]] = {}
            for key, args in operands:
                if key in given_up:
                    continue
                seconds = self._time(method, args)
                calls[key] = calls.get(key, 0) + 1
                spent.setdefault(key, []).append(seconds)
                if calls[key] > 1 and self._hopeless(key, rows, threads, seconds):
                    given_up[key] = seconds
            if rep:
                for key, times in spent.items():
                    if key not in given_up:
                        samples.setdefault(key, []).append(sum(times) / len(times))
        return {key: min(times) for key, times in samples.items()} | given_up

    def _warm(self, method: GemmKernel, rows: int, threads: int, site: GemmSite, weight: torch.Tensor) -> float:
        """The fastest of up to `reps` products of one weight after an untimed one (which creates oneDNN's
        primitives), fewer once they took `WARM_BUDGET_S`; none after a `_hopeless` one."""
        key = GemmKey.of(site)
        args = self._operands(method, rows, site, weight)
        untimed = self._time(method, args)
        if self._hopeless(key, rows, threads, untimed):
            return untimed
        times = [self._time(method, args)]
        if self._hopeless(key, rows, threads, times[0]):
            return times[0]
        while len(times) < self.reps and sum(times) < WARM_BUDGET_S:
            times.append(self._time(method, args))
        return min(times)

    def _hopeless(self, key: GemmKey, rows: int, threads: int, seconds: float) -> bool:
        best = self.fastest.get((key, rows, threads))
        return best is not None and seconds > HOPELESS * best

    def _operands(self, method: GemmKernel, rows: int, site: GemmSite, weight: torch.Tensor) -> Operands:
        """What one product of `method` reads at `rows` rows: its input, the weight and what it reads stored
        (a copy made now, its own mapping, and kept until `release`)."""
        x = self._input(GemmKey.of(site), rows, site)
        q = site.quantized
        stored: object = None
        if q is not None:
            stored = q[0] if q.experts else q
            if method.quantized_copy:
                stored = self._quantized_copy(method.quantized_copy, q)
        elif method.storage in COPIES:
            stored = self._copy(method.storage, weight)
        return x, weight, stored

    @staticmethod
    def _time(method: GemmKernel, args: Operands) -> float:
        t0 = time.perf_counter()
        method.apply(*args, None)
        return time.perf_counter() - t0

    def _input(self, key: GemmKey, rows: int, site: GemmSite) -> torch.Tensor:
        x = self.inputs.get((key, rows))
        if x is None:
            gen = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, key.in_features, generator=gen).to(site.dtype)
            self.inputs[(key, rows)] = x
        return x

    def _copy(self, storage: str, weight: torch.Tensor) -> object:
        copy = self.copies.get((storage, id(weight)))
        if copy is None:
            with blocks_mapped():
                copy = self.copies[(storage, id(weight))] = COPIES[storage](weight)
        return copy

    def _quantized_copy(self, kind: str, q: QuantizedWeight) -> QuantizedWeight:
        copy = self.quantized_copies.get((kind, id(q)))
        if copy is None:
            with blocks_mapped():
                copy = self.quantized_copies[(kind, id(q))] = q.with_copy(kind)
        return copy

    def release(self) -> None:
        """Free the copies made for timing, and the heap's free pages (the timed products' temporaries)."""
        self.copies.clear()
        self.quantized_copies.clear()
        self.inputs.clear()
        release_free_heap()


def read_tensors(site: GemmSite, weight: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a site's one-row products read: its quantized weight's, the copy of the weight its one-row
    method reads (once bound), else the dense weight."""
    q = site.quantized
    if q is not None:
        kind = site.method_for(1).quantized_copy
        if kind == "tiled4" and q.tiled4 is not None:
            return [q.tiled4.data, q.tiled4.scales]
        tiles = q.tiled if kind == "tiled" else None
        return [tiles.data, tiles.row_sums, tiles.scale] if tiles is not None else [q.data, q.scale]
    copy = site.copies.get(site.method_for(1).storage)
    if isinstance(copy, TiledWeight):
        return [copy.data]
    return [copy] if isinstance(copy, torch.Tensor) else [weight]


def weights_read(instances: list[Instance]) -> list[torch.Tensor]:
    """Every tensor the sites' products read, each once (sites may share one)."""
    return list({id(t): t for site, w in instances for t in read_tensors(site, w)}.values())


def weight_bytes(instances: list[Instance]) -> int:
    """The bytes a step that runs every product once reads from its weights."""
    return sum(t.numel() * t.element_size() for t in weights_read(instances))


def read_bytes_per_s(instances: list[Instance], reps: int = 3) -> float:
    """How fast this thread count reads the model's weights from memory: the fastest of `reps` passes
    summing each weight once, its bytes read as float32 whatever its dtype (a float32 sum runs at the
    memory's speed; what a one-row step can at best do). oneDNN's packed copies are opaque: not read."""
    words = [w.reshape(-1).view(torch.float32) for w in weights_read(instances)
             if w.layout == torch.strided and w.is_contiguous() and (w.numel() * w.element_size()) % 4 == 0
             and w.device.type == "cpu"]
    nbytes = sum(w.numel() * 4 for w in words)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for w in words:
            w.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best if best > 0 else 0.0
