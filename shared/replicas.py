"""Data-parallel replicas on one node: which processes a launch starts, and which replica each is in.

With `--dp-size N`, node 0 runs one tokenizer and N replicas. Replica D is one scheduler and its
`--tp-size` worker ranks, started with their own ServerArgs (`replica_args`): `dp_rank` D, so their
ipc endpoints are their own (shared/channels.py); their own torch.distributed rendezvous address
when tp_size > 1; on CUDA the GPUs from `base_gpu_id + D * ranks_per_node`. The tokenizer keeps the
launch's ServerArgs (dp_rank 0) and opens one pair of scheduler channels per replica.

Replicas fail independently (`ReplicaSet`): when a process of replica D dies, replica D is down and
its other processes are stopped; the launch goes on while any replica is up. The tokenizer, or the
last replica going down, ends the launch as before. With `--dp-size 1` the names, endpoints and the
rule "any death ends the launch" are what they were without replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.config import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcSpec:
    """One child process of this node: `kind` is tokenizer | scheduler | worker; `replica` is None
    for the tokenizer."""

    name: str
    kind: str
    args: ServerArgs
    rank: int | None
    replica: int | None


def dist_addrs(args: ServerArgs, free_port: Callable[[], int]) -> list[str]:
    """The torch.distributed rendezvous address of each replica ("" without TP): --dist-init-addr's
    port + D when it was given, else a free loopback port per replica."""
    if args.tp_size == 1:
        return [""] * args.dp_size
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        return [f"{host}:{int(port) + d}" for d in range(args.dp_size)]
    return [f"127.0.0.1:{free_port()}" for _ in range(args.dp_size)]


def replica_args(args: ServerArgs, dp_rank: int, dist_init_addr: str) -> ServerArgs:
    """The ServerArgs of replica `dp_rank`'s scheduler and workers."""
    changes: dict[str, object] = {"dp_rank": dp_rank,
                                  "base_gpu_id": args.base_gpu_id + dp_rank * args.ranks_per_node}  # fmt: skip
    if dist_init_addr:
        changes["dist_init_addr"] = dist_init_addr
    return args.replace(**changes)


def node_processes(args: ServerArgs, addrs: Sequence[str]) -> list[ProcSpec]:
    """Every child of this node: the workers of each replica, then (node 0) each replica's scheduler
    and the tokenizer. `addrs`: one rendezvous address per replica (`dist_addrs`)."""
    replicas = range(args.dp_size) if args.node_rank == 0 else range(1)
    specs: list[ProcSpec] = []
    for d in replicas:
        rargs = replica_args(args, d, addrs[d]) if args.dp_size > 1 else args
        specs += [ProcSpec(rargs.proc_name("worker", r), "worker", rargs, r, d) for r in args.local_ranks()]
        if args.node_rank == 0:
            specs.append(ProcSpec(rargs.proc_name("scheduler"), "scheduler", rargs, None, d))
    if args.node_rank == 0:
        specs.append(ProcSpec("tokenizer", "tokenizer", args, None, None))
    return specs


class ReplicaSet:
    """Which replicas are up. Rule: a death outside any replica (the tokenizer), any death with one
    replica, or the death of the last replica up ends the launch; any other death takes down only
    its replica."""

    def __init__(self, specs: Sequence[ProcSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        self.members: dict[int, list[str]] = {}
        for s in specs:
            if s.replica is not None:
                self.members.setdefault(s.replica, []).append(s.name)
        self.down: dict[int, str] = {}

    @property
    def up(self) -> list[int]:
        return [d for d in sorted(self.members) if d not in self.down]

    def replica_of(self, name: str) -> int | None:
        return self.specs[name].replica

    def ends_launch(self, name: str) -> bool:
        """Whether the death of `name` ends the launch (see the class rule)."""
        d = self.replica_of(name)
        if d is None or len(self.members) == 1:
            return True
        return self.up == [d]

    def take_down(self, name: str, reason: str) -> tuple[int, list[str]]:
        """Mark the replica of `name` down; returns it and its other processes (to be stopped)."""
        d = self.replica_of(name)
        assert d is not None and d not in self.down, (name, d)
        self.down[d] = reason
        return d, [n for n in self.members[d] if n != name]

    def args_of(self, d: int) -> ServerArgs:
        return next(self.specs[n].args for n in self.members[d])

    def check_integrity(self) -> None:
        assert set(self.down) <= set(self.members)
        assert all(self.specs[n].replica == d for d, names in self.members.items() for n in names)
