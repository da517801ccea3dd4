"""`bound_onednn_caches`: packed GEMMs over many distinct row counts (prefills of mixed traffic) keep a
worker's resident memory bounded instead of adding a cached oneDNN primitive per row count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker_proc.host.memory import ONEDNN_CACHE_VARS, bound_onednn_caches

# 600 packed products of distinct row counts after a warm-up of 50; prints the growth of VmRSS in MiB.
PROBE = """
import sys, torch
from worker_proc.host.memory import bound_onednn_caches
if sys.argv[1] == "on":
    bound_onednn_caches(32)
from worker_proc.linear.kernels import pack_weight, packed_product
torch.set_num_threads(1)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
packed, x = pack_weight(torch.randn(512, 128)), torch.randn(700, 128)
for rows in range(1, 51):
    packed_product(x[:rows], packed, None)
before = rss()
for rows in range(51, 651):
    packed_product(x[:rows], packed, None)
print(rss() - before)
"""


def _growth_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARS}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=root, env=env, capture_output=True, text=True,
                         timeout=240, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.backends.mkldnn.is_available(),
                    reason="reads /proc; needs oneDNN")  # fmt: skip
@pytest.mark.timeout(600)
def test_capped_caches_keep_memory_flat_over_many_row_counts() -> None:
    capped, default = _growth_mib("on"), _growth_mib("off")
    assert capped < 80, f"resident memory grew {capped:.0f} MiB with the caches capped"
    assert default > 150 and default > 3 * capped, (capped, default)  # the probe sees the growth it guards


def test_a_capacity_set_in_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_onednn_caches(64) == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def test_a_single_weight_copy_keeps_fewer_primitives() -> None:
    """`--single-weight-copy` trades speed for memory: its caches keep fewer entries than the default, yet
    still more than the seven product shapes of a layer stack's prefill chunk (one entry each)."""
    from worker_proc.host.memory import ONEDNN_CACHE_CAPACITY, onednn_cache_capacity

    assert onednn_cache_capacity(False) == ONEDNN_CACHE_CAPACITY
    assert 8 <= onednn_cache_capacity(True) < ONEDNN_CACHE_CAPACITY
