"""`DirectoryStore`: entries as files under `root/<namespace digest>/<first 2 hex of key>/<key>`, shared
by any process (and any server on a shared filesystem) that opens the same root with the same namespace.

Who owns what: each instance owns its index (key -> file size, least recently used first) and the
bytes it counts against `capacity_bytes`; the files belong to the folder, and any instance may add,
replace or evict them. A namespace's folder is only ever read or written by instances of that
namespace; other folders under the root are never opened.

Rules:
- A reader sees a whole entry or none (`entry_file`: temporary file, fsync, rename, folder fsync).
- Construction rebuilds the index from the folder, reading headers only, oldest modification first;
  it removes temporary files whose writer is gone and files whose header is bad (each logged once,
  as it is removed), then evicts down to the capacity.
- `get` reads any file of its key, indexed or not (another instance may have written it) and indexes
  it; a damaged or foreign file is logged, removed and answered None; a vanished file (evicted by
  another instance) is None and leaves the index. A get touches the file's mtime, so a restart keeps
  the recency order.
- `put` raises StoreError on any OSError and leaves no temporary file. An entry larger than the
  capacity is not stored (its key's old entry is removed).
- Each instance keeps its own index within its capacity; instances sharing a folder each bound what
  they indexed, so the folder may hold up to the sum of their capacities.
- One lock guards the index; payload reads and writes run outside it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict

from shared.state_store import entry_file as ef
from shared.state_store.keys import FORMAT_VERSION, StoreNamespace, check_key, is_key
from shared.state_store.store import Buffer, StoredEntry, StoreError

logger = logging.getLogger(__name__)

SCAN_LOG_EVERY = 10_000
NAMESPACE_FILE = "namespace.json"
_PUT_ATTEMPTS = 2  # a temporary file removed by a starting instance in the moment before its lock


class DirectoryStore:
    """One namespace's entries under `root`; see the module rules."""

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, namespace: StoreNamespace,
                 scan_log_every: int = SCAN_LOG_EVERY) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if namespace.format_version != FORMAT_VERSION:
            raise ValueError(f"namespace of format {namespace.format_version}, this store writes {FORMAT_VERSION}")
        self.namespace = namespace
        self.folder = os.path.join(os.fspath(root), namespace.digest)
        self._capacity = capacity_bytes
        self._index: OrderedDict[str, int] = OrderedDict()
        self._size = 0
        self._temp_names = ef.TempNames()
        self._lock = threading.Lock()
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._write_namespace_file()
            self._scan(max(1, scan_log_every))
        except OSError as e:
            raise StoreError(f"state store folder {self.folder}: {e}") from e

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def size_bytes(self) -> int:
        return self._size

    def path(self, key: str) -> str:
        return os.path.join(self.folder, key[:2], key)

    def _write_namespace_file(self) -> None:
        """The namespace's fields beside its entries, for people reading the folder (never read back)."""
        target = os.path.join(self.folder, NAMESPACE_FILE)
        if os.path.exists(target):
            return
        tmp = os.path.join(self.folder, self._temp_names.next(NAMESPACE_FILE))
        data = json.dumps(self.namespace.fields(), indent=1, sort_keys=True).encode()
        fd = ef.write_temp(tmp, data, memoryview(b""), memoryview(b""))
        try:
            os.rename(tmp, target)
        except FileNotFoundError:
            logger.info("state store: %s not written (its temporary file was removed)", target)
        finally:
            os.close(fd)

    # --- the index at construction ---

    def _scan(self, log_every: int) -> None:
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        seen = removed = 0
        for entry in self._scan_files():
            seen += 1
            if seen % log_every == 0:
                logger.info("state store %s: scanned %d files", self.folder, seen)
            if entry.name.startswith(ef.TMP_PREFIX):
                if ef.remove_abandoned_temp(entry.path):
                    logger.info("state store: removed the temporary file %s of an interrupted write", entry.path)
                    removed += 1
                continue
            folder = os.path.basename(os.path.dirname(entry.path))
            if not is_key(entry.name) or entry.name[:2] != folder:
                continue  # not an entry of this store: left alone
            try:
                header = ef.read_header(entry.path, self.namespace.digest, entry.name)
                found.append((entry.stat().st_mtime_ns, entry.name, header.file_size))
            except FileNotFoundError:
                continue  # another instance evicted it meanwhile
            except ef.BadEntry as e:
                self._discard(entry.name, entry.path, str(e))
                removed += 1
            except OSError as e:
                logger.warning("state store: cannot read %s: %s", entry.path, e)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._size += size
        with self._lock:
            self._evict(0, keep=None)
        logger.info("state store %s: %d entries, %d bytes of %d; %d files removed", self.folder,
                    len(self._index), self._size, self._capacity, removed)

    def _scan_files(self) -> list[os.DirEntry[str]]:
        files: list[os.DirEntry[str]] = []
        with os.scandir(self.folder) as top:
            for sub in top:
                if sub.name.startswith(ef.TMP_PREFIX):
                    files.append(sub)
                elif len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                    with os.scandir(sub.path) as inner:
                        files.extend(f for f in inner if f.is_file(follow_symlinks=False))
        return files

    # --- index helpers (called with the lock held) ---

    def _drop(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._size -= size

    def _add(self, key: str, size: int) -> None:
        self._drop(key)
        self._index[key] = size
        self._size += size

    def _evict(self, incoming: int, keep: str | None) -> None:
        """Remove least recently used entries (never `keep`) until `incoming` more bytes fit."""
        victims = [k for k in self._index if k != keep]
        for victim in victims:
            if self._size + incoming <= self._capacity:
                return
            self._drop(victim)
            try:
                ef.remove_quietly(self.path(victim))
            except OSError as e:
                logger.warning("state store: cannot evict %s: %s", victim, e)

    def _discard(self, key: str, path: str, reason: str) -> None:
        logger.warning("state store: removed the damaged entry %s: %s", path, reason)
        with self._lock:
            self._drop(key)
        try:
            ef.remove_quietly(path)
        except OSError as e:
            logger.warning("state store: cannot remove %s: %s", path, e)

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
        header = ef.pack_header(self.namespace.digest, key, meta_view, payload_view)
        subfolder = os.path.dirname(self.path(key))
        with self._lock:
            self._evict(size - self._index.get(key, 0), keep=key)
        try:
            self._make_subfolder(subfolder)
            for attempt in range(_PUT_ATTEMPTS):
                if self._write_and_rename(key, subfolder, header, meta_view, payload_view, size):
                    break
                if attempt == _PUT_ATTEMPTS - 1:
                    raise FileNotFoundError(f"temporary file of {key} removed before its rename")
            ef.fsync_dir(subfolder)
        except OSError as e:
            raise StoreError(f"state store: cannot write {key} under {self.folder}: {e}") from e

    def _make_subfolder(self, subfolder: str) -> None:
        """Create the key's folder inside the namespace folder, which must still exist (a removed or
        unmounted root is an error, never silently recreated)."""
        if not os.path.isdir(subfolder):
            try:
                os.mkdir(subfolder)
            except FileExistsError:
                return
            ef.fsync_dir(self.folder)

    def _write_and_rename(self, key: str, subfolder: str, header: bytes, meta: memoryview, payload: memoryview,
                          size: int) -> bool:
        """Write the entry and index it; False when its temporary file vanished before the rename."""
        tmp = os.path.join(subfolder, self._temp_names.next(key))
        fd = ef.write_temp(tmp, header, meta, payload)
        try:
            with self._lock:
                try:
                    os.rename(tmp, self.path(key))
                except FileNotFoundError:
                    if os.path.isdir(subfolder):
                        return False
                    raise
                self._add(key, size)
                self._evict(0, keep=key)
        except BaseException:
            ef.remove_quietly(tmp)
            raise
        finally:
            os.close(fd)
        return True

    def get(self, key: str) -> StoredEntry | None:
        check_key(key)
        path = self.path(key)
        try:
            entry = ef.read_entry(path, self.namespace.digest, key)
        except FileNotFoundError:
            with self._lock:
                self._drop(key)
            return None
        except ef.BadEntry as e:
            self._discard(key, path, str(e))
            return None
        except OSError as e:
            raise StoreError(f"state store: cannot read {path}: {e}") from e
        size = ef.entry_size(len(entry.meta), len(entry.payload))
        with self._lock:
            if key in self._index or os.path.exists(path):  # unindexed: written by another instance
                self._add(key, size)
                self._evict(0, keep=key)
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: recency no longer matters
        return entry

    def contains(self, key: str) -> bool:
        check_key(key)
        if os.path.exists(self.path(key)):
            return True
        with self._lock:
            self._drop(key)
        return False

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            self._drop(key)
            try:
                return ef.remove_quietly(self.path(key))
            except OSError as e:
                raise StoreError(f"state store: cannot delete {key}: {e}") from e

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def clear(self) -> int:
        """Remove every entry of this namespace's folder (indexed or written by another instance) and
        every temporary file whose writer is gone; returns the entries removed."""
        removed = 0
        with self._lock:
            self._index.clear()
            self._size = 0
            try:
                for entry in self._scan_files():
                    if entry.name.startswith(ef.TMP_PREFIX):
                        ef.remove_abandoned_temp(entry.path)
                    elif is_key(entry.name) and ef.remove_quietly(entry.path):
                        removed += 1
            except OSError as e:
                raise StoreError(f"state store: cannot empty {self.folder}: {e}") from e
        return removed

    def check_integrity(self) -> None:
        """The index adds up, fits the capacity, and names files of the sizes it counts."""
        with self._lock:
            assert sum(self._index.values()) == self._size, "index sizes do not add up to size_bytes"
            assert self._size <= self._capacity, f"size {self._size} > capacity {self._capacity}"
            for key, size in self._index.items():
                check_key(key)
                actual = os.stat(self.path(key)).st_size
                assert actual == size, f"{key}: file of {actual} bytes, indexed as {size}"


class DirectoryProbe:
    """Whether an entry of a namespace's folder exists, without an index (the scheduler's lookups; the
    worker's `DirectoryStore` of the same namespace owns the entries). A hint, as `contains` is."""

    def __init__(self, root: str | os.PathLike[str], namespace: StoreNamespace) -> None:
        self.folder = os.path.join(os.fspath(root), namespace.digest)

    def contains(self, key: str) -> bool:
        check_key(key)
        return os.path.exists(os.path.join(self.folder, key[:2], key))
