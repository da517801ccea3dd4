"""CPU thread policy of a worker rank (`worker_proc.process.cpu_threads`)."""

from __future__ import annotations

from shared.config import ServerArgs
from worker_proc.process import SMALL_MODEL_HIDDEN, cpu_threads

BIG = SMALL_MODEL_HIDDEN * 2


def test_ranks_share_the_node_cores_and_never_oversubscribe() -> None:
    assert cpu_threads(ServerArgs(), cores=2, hidden_size=BIG) == 2
    assert cpu_threads(ServerArgs(), cores=16, hidden_size=BIG) == 16
    assert cpu_threads(ServerArgs(tp_size=2), cores=2, hidden_size=BIG) == 1
    assert cpu_threads(ServerArgs(tp_size=4), cores=2, hidden_size=BIG) == 1  # at least one
    assert cpu_threads(ServerArgs(tp_size=4), cores=16, hidden_size=BIG) == 4
    two_nodes = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500")
    assert cpu_threads(two_nodes, cores=8, hidden_size=BIG) == 4  # two ranks on this node
    # --dp-size replicas share the node's cores too
    assert cpu_threads(ServerArgs(dp_size=2), cores=16, hidden_size=BIG) == 8
    assert cpu_threads(ServerArgs(dp_size=2, tp_size=2), cores=16, hidden_size=BIG) == 4


def test_small_models_run_one_thread_unless_told() -> None:
    assert cpu_threads(ServerArgs(), cores=16, hidden_size=SMALL_MODEL_HIDDEN - 1) == 1
    assert cpu_threads(ServerArgs(cpu_threads=3), cores=16, hidden_size=128) == 3
    assert cpu_threads(ServerArgs(cpu_threads=3), cores=16, hidden_size=BIG) == 3
