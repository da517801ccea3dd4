"""`keep_freed_memory`: a worker's step temporaries reuse the heap instead of faulting in fresh pages; `zeros`:
the pools take memory as their slots are written; `weight_tensor`: weights lie on huge pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# three steps of 16 prompts of 128 tokens on the built-in model; prints the page faults of the last
# two and whether the policy applied (set after the runner is built, which applies the steps' policy).
# "off" pins glibc's mmap threshold at its initial 128 KiB: glibc otherwise raises it as mapped blocks
# are freed, so how much a process faults without the policy depends on its allocation history
# (measured 1,500-39,000 faults on different hosts).
PROBE = """
import ctypes, ctypes.util, resource, sys, torch
from shared.config import builtin_model_dir
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.host.memory import M_MMAP_THRESHOLD, keep_freed_memory
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner
torch.set_num_threads(1)
runner = ModelRunner(builtin_model_dir(), WorkerConfig(kv_slots=4096, state_slots=16))
if sys.argv[1] == "on":
    applied = keep_freed_memory()
else:
    applied = bool(ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 128 << 10))
greedy = SamplingParams(temperature=0.0)
def step(n):
    reqs = [ReqSlice(rid=str(b), input_ids=[(7 * i + b) % 200 + 1 for i in range(128)], start_pos=0,
                     kv_slots=list(range(b * 128 + 1, b * 128 + 129)), state_slot=b + 1, sample=True,
                     sampling=greedy, output_len=0) for b in range(16)]
    runner.step(ForwardBatch(step=n, reqs=reqs, clears=list(range(1, 17))))
step(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step(2)
step(3)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, applied)
"""


def _probe(mode: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    faults, applied = out.stdout.split()[-2:]
    return int(faults), applied


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    mapped, pinned = _probe("off")
    kept, applied = _probe("on")
    assert pinned == applied == "True"
    assert mapped > 5000  # every block above the threshold is a fresh mapping: megabytes faulted in per step
    assert kept < mapped / 10


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_pool_takes_pages_only_where_written() -> None:
    import torch

    from worker_proc.host.memory import zeros

    before = _resident_mib()
    pool = zeros((4, 1024, 16384), torch.float32, "cpu")  # 256 MiB
    assert _resident_mib() - before < 32
    pool[:, 7] = 3.0  # one slot of every layer: 256 KiB
    assert _resident_mib() - before < 32
    assert float(pool[:, 7].sum()) == 3.0 * 4 * 16384 and float(pool[:, 8].abs().max()) == 0.0
    assert zeros((0, 5), torch.bfloat16, "cpu").shape == (0, 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_state_and_kv_pools_grow_with_the_slots_written() -> None:
    """A server's pools hold memory for the states and contexts it has written, not for its capacity: one
    request's state slot and a thousand KV tokens take about their bytes, however many slots there are."""
    import torch

    from shared.config import builtin_model_dir
    from worker_proc.loading.checkpoint import load_config
    from worker_proc.state.pools import StatePools

    cfg = load_config(builtin_model_dir())
    before = _resident_mib()
    pools = StatePools(cfg, kv_slots=1 << 20, state_slots=64, dtype=torch.float32, device="cpu")
    kv_mib = (pools.k.nbytes + pools.v.nbytes) / 2**20
    state_mib = sum(t.nbytes for t in pools.states.values()) / 2**20
    assert kv_mib > 64 and state_mib > 8
    assert _resident_mib() - before < 4
    for name in pools.states:
        pools.states[name][:, 3] = 1.0  # one request's state slot
    pools.k[:, 1:1025] = 1.0
    pools.v[:, 1:1025] = 1.0
    written = state_mib / 65 + kv_mib * 1024 / ((1 << 20) + 1)
    assert _resident_mib() - before < written + 4
    assert float(pools.states[next(iter(pools.states))][:, 4].abs().max()) == 0.0


TRIM_PROBE = """
import torch
from shared.heap import release_free_heap
from worker_proc.host.memory import keep_freed_memory
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) >> 10
assert keep_freed_memory()
blocks = [torch.ones(1 << 20) for _ in range(256)]  # 4 MiB each: heap blocks under the mmap threshold
kept = blocks[::8]
del blocks
held = anon()
released = release_free_heap()
print(held, anon(), released, float(sum(b.sum() for b in kept)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_what_load_left_free_goes_back_to_the_kernel() -> None:
    """Under `keep_freed_memory` freed heap blocks stay resident (a step reuses them); what load freed
    (dense weights replaced by packed copies, timing copies) is given back once, also from inside the
    heap: every eighth 4 MiB block is still alive above and below the freed ones."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=120, check=True)
    held, after, released, total = out.stdout.split()
    assert released == "True" and float(total) == 32 * (1 << 20)
    assert int(held) - int(after) > 700, (held, after)  # of the 896 MiB freed between the live blocks


LOAD_PROBE = """
import sys, torch
from worker_proc.host.memory import keep_freed_memory, map_load_blocks
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) >> 10
assert (map_load_blocks() if sys.argv[1] == "mapped" else keep_freed_memory())
blocks = [torch.ones(1 << 20) for _ in range(256)]  # 4 MiB each, as the weights load
kept = blocks[::8]  # the others replaced, as dense weights by packed copies
held = anon()
del blocks
freed = anon()
assert keep_freed_memory()
print(held, freed, float(sum(b.sum() for b in kept)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_what_the_load_frees_goes_back_to_the_kernel_whole_and_at_once() -> None:
    """Under `map_load_blocks` every block the load frees was its own mapping: the 896 MiB freed between the
    live blocks leave resident memory at once, with no trim and no hole left in the heap. The steps' order
    (`keep_freed_memory` first) keeps them resident."""

    def probe(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", LOAD_PROBE, mode], capture_output=True, text=True,
                             timeout=120, check=True)  # fmt: skip
        held, freed, total = out.stdout.split()
        assert float(total) == 32 * (1 << 20)
        return int(held), int(freed)

    held, freed = probe("mapped")
    assert held - freed > 850, (held, freed)
    held, freed = probe("heap")
    assert held - freed < 100, (held, freed)


def _huge_page_mode() -> str:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), "" where it has none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _mapping_kib(address: int) -> dict[str, int]:
    """The kB figures (Rss, AnonHugePages, ...) of the mapping of this process that holds `address`."""
    inside, found = False, {}
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            if inside:
                return found
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.endswith(" kB"):
            key, value = line.split(":", 1)
            found[key] = int(value.split()[0])
    if inside:
        return found
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_weight_of_a_huge_page_or_more_starts_on_one_and_is_advised_onto_them() -> None:
    """A few-row product streams the whole weight each step: the loader's storage starts on a 2 MiB
    boundary and, where the kernel offers transparent huge pages, the load faults it in as 2 MiB pages."""
    import torch

    from worker_proc.host.memory import HUGE_PAGE_BYTES, weight_tensor

    rows = 1024 + 3  # 16 MiB and three rows: the last huge page is not filled
    w = weight_tensor((rows, 4096), torch.float32)
    assert w.shape == (rows, 4096) and w.dtype == torch.float32 and w.is_contiguous()
    assert w.data_ptr() % HUGE_PAGE_BYTES == 0
    w.copy_(torch.arange(w.numel(), dtype=torch.float32).view(rows, 4096))  # as the loader fills it
    assert float(w[rows - 1, 4095]) == w.numel() - 1
    kib = _mapping_kib(w.data_ptr())
    assert kib["Rss"] <= w.numel() * 4 // 1024 + 4  # the weight's bytes resident, not them rounded up to 2 MiB
    if _huge_page_mode() in ("always", "madvise"):
        assert kib["AnonHugePages"] >= HUGE_PAGE_BYTES >> 10
    small = weight_tensor((64, 64), torch.bfloat16)  # cannot fill a huge page: an ordinary tensor
    assert small.shape == (64, 64) and small.dtype == torch.bfloat16


def test_model_weights_are_built_on_huge_page_storage_with_their_initial_values() -> None:
    """The model's linear layers and parameters (filled by the loader) take `weight_tensor`'s storage on the
    CPU, and a linear layer keeps the values nn.Linear initialised it with."""
    import torch

    from worker_proc.host.memory import HUGE_PAGE_BYTES
    from worker_proc.model.layers import Linear, empty_param

    torch.manual_seed(5)
    want = torch.nn.Linear(1024, 1024, bias=True).weight.detach().clone()
    torch.manual_seed(5)
    layer = Linear(1024, 1024, bias=True, dtype=torch.float32, device=torch.device("cpu"))
    assert layer.weight.data_ptr() % HUGE_PAGE_BYTES == 0 and torch.equal(layer.weight, want)
    param = empty_param(2048, 512, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert param.data_ptr() % HUGE_PAGE_BYTES == 0 and not param.requires_grad
    assert empty_param(2048, 512, dtype=torch.bfloat16, device=torch.device("meta")).is_meta


def test_a_tiled_copy_of_a_large_weight_lies_on_huge_pages_and_holds_the_weight() -> None:
    """The tiled copy is what a step of few rows streams instead of the dense weight: it takes the same
    huge-page storage, and the kernel refuses a buffer that is not the layout's size."""
    import torch

    from worker_proc.host.memory import HUGE_PAGE_BYTES
    from worker_proc.kernels import native
    from worker_proc.linear.kernels import tile_weight, untile_weight

    if not native.load():
        pytest.skip("the native kernels are not built here")
    weight = torch.randn(1000, 1024)  # 1000 rows: the last block of 16 is padded
    tiled = tile_weight(weight)
    assert tiled.data.data_ptr() % HUGE_PAGE_BYTES == 0 and torch.equal(untile_weight(tiled), weight)
    if _huge_page_mode() in ("always", "madvise"):
        assert _mapping_kib(tiled.data.data_ptr())["AnonHugePages"] >= HUGE_PAGE_BYTES >> 10
    with pytest.raises(RuntimeError, match="out must be a contiguous buffer"):
        torch.ops.hyssm_cpu.tile_weight(weight, torch.empty(1000 * 1024))



# a worker's load: the load's policy on, then (mode "steps") the steps' policy, as the model runner applies it
# once the weights are loaded, then the plan times a product with megabytes of temporaries (128 rows of a
# 4096x768 float32 weight: a 2 MiB output, alone above the load's 64 KiB threshold); prints the page faults
# of each call of four timings (an untimed call and three timed each), the anonymous memory (KiB) a 16 MiB
# copy made under `blocks_mapped` gives back when freed, and the same for a 16 MiB temporary made after it
TIMER_PROBE = """
import resource, sys, torch
from worker_proc.host.memory import blocks_mapped, keep_freed_memory, map_load_blocks
from worker_proc.linear.site import GemmSite
from worker_proc.linear.kernels import GemmKernel
from worker_proc.plan.product_timer import ProductTimer
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon"))
calls = []
def product(x, weight, stored, bias):
    before = faults()
    out = torch.nn.functional.linear(x, weight)
    calls.append(faults() - before)
    return out
applied = map_load_blocks() and (sys.argv[1] == "load" or keep_freed_memory())
torch.set_num_threads(1)
timer = ProductTimer([(GemmSite(4096, 768, torch.float32, True), torch.randn(4096, 768))], cache_bytes=1 << 20,
                     reps=3)
method = GemmKernel("probe", "dense", product)
for _ in range(4):
    timer(method, 128, 1)
timer.release()
with blocks_mapped():
    copy = torch.ones(1024, 4096)
held = anon()
del copy
copy_back = held - anon()
temporary = torch.ones(1024, 4096)
held = anon()
del temporary
print(",".join(map(str, calls)), copy_back, held - anon(), applied)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_the_plan_times_products_under_the_steps_policy_and_its_copies_are_mappings() -> None:
    """Under the load's policy a timed product's temporaries are fresh mappings faulted in on every call,
    which no step pays: the worker times its plan once the steps' policy applies, so a product's calls
    reuse the pages of the first ones. A weight copy the plan makes (`blocks_mapped`) is a mapping that
    goes back whole when freed, while a step's temporary stays in the heap for the next step."""

    def probe(mode: str) -> tuple[list[int], int, int]:
        out = subprocess.run([sys.executable, "-c", TIMER_PROBE, mode], capture_output=True, text=True,
                             timeout=120, check=True)  # fmt: skip
        calls, copy_back, temporary_back, applied = out.stdout.split()
        assert applied == "True"
        return [int(c) for c in calls.split(",")], int(copy_back), int(temporary_back)

    pages = 128 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")  # of one product's output
    load_calls, _, _ = probe("load")
    assert len(load_calls) == 16 and min(load_calls) > pages // 2, load_calls  # the probe can tell
    steps_calls, copy_back, temporary_back = probe("steps")
    # the timer keeps a timing's fastest call: once the heap has settled (the first timing), one without faults
    timed = [min(steps_calls[i + 1 : i + 4]) for i in range(4, 16, 4)]
    assert len(steps_calls) == 16 and max(timed) < pages // 20, (steps_calls, load_calls)
    assert copy_back > 15 * 1024, copy_back  # KiB: the copy's 16 MiB went back to the kernel
    assert temporary_back < 1024, temporary_back  # the temporary's stayed in the heap
