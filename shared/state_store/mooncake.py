"""`MooncakeStore`: the state store on a Mooncake Store cluster (the distributed KV store that SGLang and
vLLM deployments use for KV offloading), shared by every process that names the same master and namespace.

Who owns what: the Mooncake cluster owns the bytes. A `mooncake_master` keeps the key -> replica map;
the memory lives in segments that clients mount. A `MooncakeStore` mounts none by default
(`segment_bytes=0`): its entries live in the segments of standalone `mooncake_client` processes (or other
servers' clients), so they outlive the server that wrote them. With `segment_bytes > 0` this instance's
own memory joins the pool, and whatever Mooncake placed there is gone when it closes. Each instance owns
its index (key -> value size, least recently used first) and the bytes it counts against
`capacity_bytes`; any instance of the namespace may add, replace or remove values.

Rules (and those of `store.py`):
- A key is stored in Mooncake as `<namespace digest>/<key>`: a namespace never reads another's values.
  A value is `entry_file`'s 96-byte header (magic, format version, namespace digest, key, meta and
  payload lengths, crc32 of meta + payload, the header's own crc32) + meta + payload; `get` checks all of
  it, and a damaged, truncated or foreign value is logged, removed and answered None.
- `put` upserts (replaces any value of the key) or raises StoreError (master unreachable, no segment
  with room, an entry larger than the local transfer buffer `buffer_bytes`). The puts of one instance,
  its removals and its index changes run one at a time; gets run beside them.
- `get` indexes any valid value of its key (another instance may have written it). Values the master
  evicted or another instance removed leave the index at the next `get` of their key; `contains` asks
  the master (`is_exist`) and leaves the index alone. Removals are forced: a lease (the master grants
  one on each get and is_exist, 10 s by default) does not keep an entry this store evicts.
- `clear` removes every value of the namespace (`remove_by_regex`), whoever wrote it.
- Bounded waits: construction checks that the master accepts a TCP connection and gives `setup`
  `setup_timeout_s`. Until a call has found the master gone, a call may take the client's own connect
  retries (about 4.5 s; a get up to twice that); from then on, while the master refuses TCP
  connections, every call raises StoreError at once; calls resume when it answers again (a restarted
  master starts empty). The Mooncake calls release the GIL.
- `mooncake` is imported on construction only: this module imports without it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from shared.state_store import entry_file as ef
from shared.state_store.keys import FORMAT_VERSION, StoreNamespace, check_key
from shared.state_store.store import Buffer, StoredEntry, StoreError

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on CUDA machines); "
                "its extension needs Debian's libibverbs1 and librdmacm1 (apt-get install -y libibverbs1 librdmacm1)")
METADATA_SERVER = "P2PHANDSHAKE"  # clients exchange transfer metadata directly: no etcd or HTTP metadata server
DEFAULT_SEGMENT_BYTES = 0
DEFAULT_BUFFER_BYTES = 256 << 20
SETUP_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 1.0  # a TCP connect to the master
LOOKUP_TIMEOUT_S = 0.5  # a MooncakeProbe lookup
OBJECT_NOT_FOUND = -704
RPC_ERRORS = range(-999, -899)  # RPC_FAIL (-900) and kin: the master did not answer


def _client_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as e:
        raise StoreError(f"Mooncake Store is not usable on this machine ({e}): {INSTALL_HINT}") from e
    return MooncakeDistributedStore


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a Mooncake master address is host:port, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _reachable(address: str) -> bool:
    try:
        with socket.create_connection(_host_port(address), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception as e:  # noqa: BLE001 - closing is best effort
        logger.debug("Mooncake client close: %s", e)


def _setup(address: str, args: tuple[Any, ...], timeout_s: float) -> Any:
    """A client set up with `args`, or StoreError after `timeout_s` (the client's own retries run for
    minutes); a setup that finishes after it was given up is closed."""
    client = _client_class()()
    lock, done = threading.Lock(), threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            result: Any = client.setup(*args)
        except Exception as e:  # noqa: BLE001 - reported by the waiting thread
            result = e
        with lock:
            if outcome.setdefault("result", result) == "abandoned":
                _close_quietly(client)
        done.set()

    threading.Thread(target=run, name="mooncake-setup", daemon=True).start()
    done.wait(timeout_s)
    with lock:
        result = outcome.setdefault("result", "abandoned")
    if result == "abandoned":
        raise StoreError(f"Mooncake setup with master {address} did not finish in {timeout_s:.0f} s")
    if result != 0:
        _close_quietly(client)
        raise StoreError(f"Mooncake setup with master {address} failed: {result!r}")
    return client


class _Connection:
    """One Mooncake client and what is known of its master's reachability (see the module rules)."""

    def __init__(self, master_address: str, local_hostname: str, protocol: str, segment_bytes: int,
                 buffer_bytes: int, setup_timeout_s: float, rdma_devices: str = "") -> None:
        _host_port(master_address)
        self.address = master_address
        _client_class()
        if not _reachable(master_address):
            raise StoreError(f"Mooncake master {master_address} is unreachable")
        args = (local_hostname, METADATA_SERVER, segment_bytes, buffer_bytes, protocol, rdma_devices, master_address)
        self.client = _setup(master_address, args, setup_timeout_s)
        self._down = False

    def call(self, what: str, method: Callable[..., Any], *args: Any) -> Any:
        if self._down and not _reachable(self.address):
            raise StoreError(f"Mooncake {what}: master {self.address} unreachable")
        result = method(*args)
        if isinstance(result, int) and result in RPC_ERRORS:
            if not self._down:
                logger.warning("Mooncake master %s stopped answering (error %d)", self.address, result)
            self._down = True
            raise StoreError(f"Mooncake {what}: master {self.address} did not answer (error {result})")
        if self._down:
            logger.warning("Mooncake master %s answers again", self.address)
            self._down = False
        return result

    def mark_down(self) -> None:
        """A call failed in a way the client does not tell apart: the next ones check the master first."""
        self._down = True

    def close(self) -> None:
        _close_quietly(self.client)


def decode(raw: bytes, namespace: str, key: str) -> StoredEntry:
    """The checked entry of a value; `entry_file.BadEntry` when it is damaged or not this key's."""
    header = ef.parse_header(raw)
    ef.check_header(header, namespace, key, len(raw))
    view = memoryview(raw)
    meta = view[ef.HEADER_SIZE:ef.HEADER_SIZE + header.meta_len]
    payload = view[ef.HEADER_SIZE + header.meta_len:]
    if zlib.crc32(payload, zlib.crc32(meta)) != header.crc:
        raise ef.BadEntry("payload checksum mismatch")
    return StoredEntry(meta=bytes(meta), payload=bytes(payload))


class MooncakeStore:
    """One namespace's entries in a Mooncake Store; see the module rules."""

    def __init__(self, master_address: str, capacity_bytes: int, namespace: StoreNamespace,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 setup_timeout_s: float = SETUP_TIMEOUT_S, rdma_devices: str = "") -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if namespace.format_version != FORMAT_VERSION:
            raise ValueError(f"namespace of format {namespace.format_version}, this store writes {FORMAT_VERSION}")
        self.namespace = namespace
        self._digest = namespace.digest
        self._capacity = capacity_bytes
        self._buffer_bytes = buffer_bytes
        self._index: OrderedDict[str, int] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()  # the index
        self._write_lock = threading.Lock()  # this instance's puts, removals and index growth, in turn
        self._conn = _Connection(master_address, local_hostname, protocol, segment_bytes, buffer_bytes,
                                 setup_timeout_s, rdma_devices)
        self._client = self._conn.client
        logger.info("state store on Mooncake master %s, namespace %s, capacity %d bytes", master_address,
                    self._digest[:12], capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def size_bytes(self) -> int:
        return self._size

    def mooncake_key(self, key: str) -> str:
        return f"{self._digest}/{key}"

    def close(self) -> None:
        """Disconnect (with `segment_bytes > 0`, the values placed in this instance's segment go too)."""
        self._conn.close()

    # --- index helpers (called with `_lock` held) ---

    def _drop(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._size -= size

    def _add(self, key: str, size: int) -> None:
        self._drop(key)
        self._index[key] = size
        self._size += size

    # --- Mooncake helpers (called with `_write_lock` held) ---

    def _remove(self, key: str) -> bool:
        rc = self._conn.call("remove", self._client.remove, self.mooncake_key(key), True)
        if rc not in (0, OBJECT_NOT_FOUND):
            raise StoreError(f"Mooncake remove of {key}: error {rc}")
        return rc == 0

    def _evict(self, incoming: int, keep: str | None) -> None:
        """Remove least recently used entries (never `keep`) until `incoming` more bytes fit."""
        victims: list[str] = []
        with self._lock:
            for victim in list(self._index):
                if self._size + incoming <= self._capacity:
                    break
                if victim != keep:
                    self._drop(victim)
                    victims.append(victim)
        for victim in victims:
            self._remove(victim)

    # --- the StateStore interface ---

    def put(self, key: str, payload: Buffer, meta: Buffer = b"") -> None:
        check_key(key)
        payload_view, meta_view = memoryview(payload).cast("B"), memoryview(meta).cast("B")
        size = ef.entry_size(meta_view.nbytes, payload_view.nbytes)
        if size > self._capacity:
            logger.debug("state store: entry %s of %d bytes exceeds the capacity %d: not stored", key, size,
                         self._capacity)
            self.delete(key)
            return
        if size > self._buffer_bytes:
            raise StoreError(f"Mooncake put of {key}: {size} bytes exceed the transfer buffer (buffer_bytes="
                             f"{self._buffer_bytes})")
        header = ef.pack_header(self._digest, key, meta_view, payload_view)
        with self._write_lock:
            with self._lock:
                held = self._index.get(key, 0)
            self._evict(size - held, keep=key)
            try:
                rc = self._conn.call("put", self._client.upsert_parts, self.mooncake_key(key), header, meta_view,
                                     payload_view)
                if rc != 0:
                    raise StoreError(f"Mooncake put of {key} ({size} bytes): error {rc}")
            except StoreError:
                with self._lock:
                    self._drop(key)  # whatever the key held is unknown now
                raise
            with self._lock:
                self._add(key, size)
            self._evict(0, keep=key)

    def get(self, key: str) -> StoredEntry | None:
        check_key(key)
        mkey = self.mooncake_key(key)
        raw = self._conn.call("get", self._client.get, mkey)
        if not raw:  # missing, or unreadable: is_exist tells an unreachable master apart
            exists = self._conn.call("get", self._client.is_exist, mkey)
            if exists == 1:
                logger.debug("state store: %s exists but could not be read", key)
            with self._lock:
                self._drop(key)
            return None
        try:
            entry = decode(raw, self._digest, key)
        except ef.BadEntry as e:
            logger.warning("state store: removed the damaged Mooncake value %s: %s", mkey, e)
            with self._write_lock:
                with self._lock:
                    self._drop(key)
                self._remove(key)
            return None
        size = len(raw)
        with self._lock:
            held = self._index.get(key)
            if held is not None and held >= size:  # indexed, and no larger than counted
                self._add(key, size)
                return entry
        with self._write_lock:  # new to the index (or grown): it may still be there, and room is made
            if self._conn.call("get", self._client.is_exist, mkey) == 1:
                with self._lock:
                    self._add(key, size)
                self._evict(0, keep=key)
        return entry

    def contains(self, key: str) -> bool:
        check_key(key)
        return self._conn.call("contains", self._client.is_exist, self.mooncake_key(key)) == 1

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._write_lock:
            with self._lock:
                self._drop(key)
            return self._remove(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def clear(self) -> int:
        """Remove every value of this namespace, indexed or written by another instance; returns how many."""
        with self._write_lock:
            with self._lock:
                known = list(self._index)
                self._index.clear()
                self._size = 0
            if not hasattr(self._client, "remove_by_regex"):  # older Mooncake: what this instance knows
                return sum(self._remove(k) for k in known)
            removed = self._conn.call("clear", self._client.remove_by_regex, f"^{self._digest}/[0-9a-f]{{64}}$",
                                      True)
            if removed < 0:
                raise StoreError(f"Mooncake clear of namespace {self._digest}: error {removed}")
            return int(removed)

    def check_integrity(self) -> None:
        """The index adds up, fits the capacity, and names values of the sizes it counts."""
        with self._lock:
            index = dict(self._index)
            assert sum(index.values()) == self._size, "index sizes do not add up to size_bytes"
            assert self._size <= self._capacity, f"size {self._size} > capacity {self._capacity}"
        for key, size in index.items():
            check_key(key)
            actual = self._conn.call("check", self._client.get_size, self.mooncake_key(key))
            assert actual == size, f"{key}: Mooncake holds {actual} bytes, indexed as {size}"


class MooncakeProbe:
    """Whether a value of a namespace exists, for the scheduler's lookups: a light client (no segment, no
    transfer buffer) that only asks the master. A hint, as `contains` is: False when the master does
    not answer within `lookup_timeout_s` (logged once per outage; the client's retries run on its own
    thread meanwhile, and lookups answer False at once until it returns). Construction raises
    StoreError as `MooncakeStore`'s does."""

    def __init__(self, master_address: str, namespace: StoreNamespace, local_hostname: str = "127.0.0.1",
                 protocol: str = "tcp", setup_timeout_s: float = SETUP_TIMEOUT_S,
                 lookup_timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self._digest = namespace.digest
        self._timeout = lookup_timeout_s
        self._conn = _Connection(master_address, local_hostname, protocol, 0, 0, setup_timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mooncake-probe")
        self._stuck: concurrent.futures.Future[Any] | None = None
        self._failing = False

    def _lookup(self, names: list[str]) -> list[int]:
        if self._stuck is not None and not self._stuck.done():
            raise StoreError(f"Mooncake lookup: master {self._conn.address} did not answer")
        future = self._pool.submit(self._conn.call, "lookup", self._conn.client.batch_is_exist, names)
        try:
            found: list[int] = future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            self._stuck = future
            self._conn.mark_down()
            raise StoreError(f"Mooncake lookup: master {self._conn.address} silent for {self._timeout} s") from None
        if -1 in found:  # an error, most likely the master's: later lookups check it first
            self._conn.mark_down()
            raise StoreError(f"Mooncake lookup: master {self._conn.address} did not answer")
        return found

    def _exists(self, keys: list[str]) -> list[bool]:
        names = [f"{self._digest}/{check_key(k)}" for k in keys]
        try:
            found = self._lookup(names)
        except StoreError as e:
            if not self._failing:
                logger.warning("state store lookups answer False: %s", e)
            self._failing = True
            return [False] * len(keys)
        self._failing = False
        return [rc == 1 for rc in found]

    def contains(self, key: str) -> bool:
        return self._exists([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """`contains` of each key, in one round trip to the master."""
        return self._exists(list(keys)) if keys else []

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._conn.close()
