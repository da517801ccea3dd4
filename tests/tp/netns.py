"""Two "hosts" on one machine: network namespaces A and B joined by a veth pair, A at 10.77.0.1/24
and B at 10.77.0.2/24, each with its loopback up. Nothing is added to the root namespace.

Names are unique per use (`hy<6 hex>a`/`b` for both the namespaces and the veth ends), and
`close()` deletes what `create()` made even after a failure half-way (deleting a namespace
deletes the veth end inside it, and with it the pair). A thread enters a namespace with
`enter()` (setns(2) on the calling thread only: sockets it opens afterwards live there), which
is how the test's HTTP clients reach node 0's 127.0.0.1 inside A.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

import pytest

CLONE_NEWNET = 0x40000000
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def skip_unless_netns_possible() -> None:
    """Skip the calling test, naming why, where namespaces cannot be made here."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")


def enter(name: str) -> None:
    """Move the calling thread into network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class HostPair:
    tag: str = field(default_factory=lambda: f"hy{uuid.uuid4().hex[:6]}")
    made: list[str] = field(default_factory=list)  # namespaces created so far

    @property
    def ns_a(self) -> str:
        return self.tag + "a"

    @property
    def ns_b(self) -> str:
        return self.tag + "b"

    @property
    def dev_a(self) -> str:
        return self.tag + "a"  # the veth end inside A (interface names live per namespace)

    @property
    def dev_b(self) -> str:
        return self.tag + "b"

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def create(self) -> None:
        """Make both namespaces and the link; skip (naming the failure) when the kernel refuses."""
        try:
            for ns in (self.ns_a, self.ns_b):
                _ip("netns", "add", ns)
                self.made.append(ns)
        except RuntimeError as e:
            self.close()
            pytest.skip(f"cannot create network namespaces here: {e}")
        try:
            # created inside A with its peer inside B: no interface ever appears in the root namespace
            _ip("-n", self.ns_a, "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b,
                "netns", self.ns_b)  # fmt: skip
            for ns, dev, addr in ((self.ns_a, self.dev_a, ADDR_A), (self.ns_b, self.dev_b, ADDR_B)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def link_down(self) -> None:
        """The partition: A's end of the link goes down (B's end loses its carrier)."""
        _ip("-n", self.ns_a, "link", "set", self.dev_a, "down")

    def pids(self, ns: str) -> list[int]:
        res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
        return [int(p) for p in res.stdout.split()]

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.made.clear()
