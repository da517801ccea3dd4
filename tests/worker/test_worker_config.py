"""`WorkerConfig` (worker_proc.runtime.config), the one object a `ModelRunner` is built from, and the host
settings a worker process applies once (worker_proc.host.setup)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import ServerArgs
from worker_proc.runtime.config import WorkerConfig


@pytest.mark.parametrize("bad", [
    {"kv_slots": -1}, {"state_slots": -5}, {"mem_budget_bytes": -1}, {"seed": -1}, {"running_requests": -2},
    {"mem_fraction_static": 0.0}, {"mem_fraction_static": 1.5}, {"state_ratio": 1.0}, {"state_ratio": 0.0},
    {"tp_rank": 2, "tp_size": 2}, {"tp_rank": -1}, {"thread_options": (0, 2)},
])
def test_a_bad_config_is_refused_at_construction_naming_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match="bad worker config") as err:
        WorkerConfig(**bad)
    assert any(name.split("_")[0] in str(err.value) for name in bad)


def test_the_config_is_frozen() -> None:
    c = WorkerConfig()
    with pytest.raises(AttributeError):
        c.kv_slots = 3  # type: ignore[misc]


def test_from_server_args_carries_every_flag(tmp_path: Path) -> None:
    args = ServerArgs(dtype="bfloat16", mamba_ssm_dtype="bfloat16", max_total_tokens=4096, max_mamba_cache_size=12,
                      mem_budget_gb=0.5, mem_fraction_static=0.7, max_running_requests=9,
                      mamba_full_memory_ratio=0.3, random_seed=5, tp_size=2, enable_deterministic_inference=True,
                      kernels="reference", single_weight_copy=True, quantization="int8",
                      disable_lm_head_quantization=True, enforce_eager=True, dist_init_addr="127.0.0.1:29511")
    c = WorkerConfig.from_server_args(args, device="cpu", rank=1, thread_options=(1, 2), plan_cache_dir=tmp_path)
    assert (c.dtype, c.state_dtype, c.kv_slots, c.state_slots) == ("bfloat16", "bfloat16", 4096, 12)
    assert c.mem_budget_bytes == 1 << 29 and c.mem_fraction_static == 0.7 and c.running_requests == 9
    assert (c.state_ratio, c.seed, c.tp_rank, c.tp_size) == (0.3, 5, 1, 2)
    assert c.deterministic and c.kernels == "reference" and c.single_weight_copy and c.enforce_eager
    assert c.quantization == "int8" and not c.quantize_lm_head
    assert c.thread_options == (1, 2) and c.plan_cache_dir == tmp_path


SETUP = """
import torch
from shared.config import ServerArgs
from worker_proc.host.numerics import denormals_flushed
from worker_proc.host.setup import apply_host_settings
import os
host = apply_host_settings(ServerArgs(cpu_threads=1), 0, "cpu")
assert host.thread_options == (1,) and torch.get_num_threads() == 1, host
assert denormals_flushed()
assert all(os.environ[v] for v in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"))
print("applied")
"""


def test_host_settings_apply_threads_denormals_and_caches_in_a_fresh_process() -> None:
    out = subprocess.run([sys.executable, "-c", SETUP], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "applied"
