"""CPU thread policy of a worker rank (`worker_proc.threads`)."""

from __future__ import annotations

import pytest
import torch

from shared.config import ServerArgs, builtin_model_dir
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.runtime import ModelRunner
from worker_proc.threads import LARGE_STEP_ROWS, SMALL_MODEL_HIDDEN, StepThreads, cpu_threads

BIG = SMALL_MODEL_HIDDEN * 2


def _share(args: ServerArgs, cores: int) -> int:
    threads = cpu_threads(args, cores=cores, hidden_size=BIG)
    assert threads.small == threads.large  # a large model uses its share on every step
    return threads.small


def test_ranks_share_the_node_cores_and_never_oversubscribe() -> None:
    assert _share(ServerArgs(), cores=2) == 2
    assert _share(ServerArgs(), cores=16) == 16
    assert _share(ServerArgs(tp_size=2), cores=2) == 1
    assert _share(ServerArgs(tp_size=4), cores=2) == 1  # at least one
    assert _share(ServerArgs(tp_size=4), cores=16) == 4
    two_nodes = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500")
    assert _share(two_nodes, cores=8) == 4  # two ranks on this node
    # --dp-size replicas share the node's cores too
    assert _share(ServerArgs(dp_size=2), cores=16) == 8
    assert _share(ServerArgs(dp_size=2, tp_size=2), cores=16) == 4


def test_small_models_decode_on_one_thread_and_split_large_steps() -> None:
    small = cpu_threads(ServerArgs(), cores=16, hidden_size=SMALL_MODEL_HIDDEN - 1)
    assert small == StepThreads(1, 16)
    assert small.for_rows(1) == small.for_rows(LARGE_STEP_ROWS - 1) == 1
    assert small.for_rows(LARGE_STEP_ROWS) == small.for_rows(4096) == 16
    assert cpu_threads(ServerArgs(tp_size=2), cores=2, hidden_size=128) == StepThreads(1, 1)
    assert cpu_threads(ServerArgs(cpu_threads=3), cores=16, hidden_size=128) == StepThreads(3, 3)
    assert cpu_threads(ServerArgs(cpu_threads=3), cores=16, hidden_size=BIG) == StepThreads(3, 3)
    with pytest.raises(ValueError, match="thread counts"):
        StepThreads(0, 2)


def test_the_runner_sets_each_steps_threads() -> None:
    """A decode step runs on `small` threads, a step of LARGE_STEP_ROWS prompt rows on `large`."""
    before = torch.get_num_threads()
    runner = ModelRunner(builtin_model_dir(), kv_slots=2048, mamba_slots=4, threads=StepThreads(1, 2))
    seen: list[int] = []
    forward = runner.model.forward_step
    runner.model.forward_step = lambda *a, **k: (seen.append(torch.get_num_threads()), forward(*a, **k))[1]
    greedy = SamplingParams(temperature=0.0)
    try:
        n = LARGE_STEP_ROWS
        prompt = ReqSlice(rid="a", input_ids=[3] * n, start_pos=0, kv_slots=list(range(1, n + 1)), mamba_slot=1,
                          sample=True, sampling=greedy, output_len=0)  # fmt: skip
        tok = runner.step(ForwardBatch(step=1, reqs=[prompt], clears=[1])).next_tokens["a"]
        decode = ReqSlice(rid="a", input_ids=[tok], start_pos=n, kv_slots=list(range(1, n + 2)), mamba_slot=1,
                          sample=True, sampling=greedy, output_len=1)  # fmt: skip
        runner.step(ForwardBatch(step=2, reqs=[decode]))
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 1]
