"""TP=2 against TP=1 and transformers for a family's checkpoints (tests/fixtures/family_checkpoint.py):
tests/tp/test_tp_parity.py's serving script traced on one process and on two gloo ranks, and the
checks a family's TP test makes of those traces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from tests.tp.harness import models_traces, run_ranks
from tests.tp.test_tp_parity import N_NEW, TOL, _compare
from worker_proc.loading.checkpoint import load_config
from worker_proc.state.pools import slot_bytes

Traces = tuple[dict[str, Any], list[dict[str, Any]]]
"""(the TP=1 traces by checkpoint name, the TP=2 ranks' traces by checkpoint name)."""


def family_traces(names: Sequence[str], model_dir: Callable[[str], str], timeout: float) -> Traces:
    """The serving script's traces (N_NEW tokens, the reference prompt's logits) of every checkpoint of
    `names`, on one process and then on two ranks that must finish within `timeout` seconds."""
    jobs = [(name, model_dir(name), N_NEW, _prompt_of(model_dir(name))) for name in names]
    return models_traces(0, 1, None, jobs), run_ranks(models_traces, 2, (jobs,), timeout=timeout)


def _prompt_of(path: str) -> list[int]:
    return load_file(f"{path}/reference.safetensors")["prompt"].tolist()


def check_tp2_matches_tp1_and_transformers(traces: Traces, name: str, model_dir: str) -> None:
    """Checkpoint `name` at TP=2: greedy tokens identical to TP=1's, logits within TOL of them at every step
    and the same on both ranks (test_tp_parity's `_compare`); the prompt's logits on every rank and at TP=1
    within TOL of transformers' reference in `model_dir`."""
    tp1, tp2 = traces
    _compare(tp1[name], [r[name] for r in tp2])
    hf = load_file(f"{model_dir}/reference.safetensors")["prompt_logits"].numpy()
    for r in (tp1, *tp2):
        assert float(np.abs(r[name]["prompt_logits"] - hf).max()) <= TOL


def check_tp2_pools_per_rank(traces: Traces, name: str, model_dir: str) -> None:
    """Both ranks plan the TP=1 token and state slot counts, each in fewer bytes than TP=1; a state slot of
    the checkpoint in `model_dir` costs each of two ranks exactly half its float32 bytes at TP=1 (and is
    not empty)."""
    tp1, tp2 = traces
    kv, states, nbytes = tp1[name]["capacity"]
    for r in tp2:
        r_kv, r_states, r_bytes = r[name]["capacity"]
        assert (r_kv, r_states) == (kv, states) and r_bytes < nbytes  # KV costs as much where a KV head is replicated
    cfg = load_config(model_dir)
    whole = slot_bytes(cfg, torch.float32).state_slot
    assert whole > 0 and all(2 * slot_bytes(cfg, torch.float32, 2, rank).state_slot == whole for rank in (0, 1))
