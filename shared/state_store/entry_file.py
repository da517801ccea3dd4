"""One entry file of a `DirectoryStore`: its byte layout, writing it so that a reader sees all of it or
nothing, and reading it back checked. Used only by `directory.py`.

Layout (little-endian):
    offset  size  field
    0       8     magic b"HYSSMST\\0"
    8       4     format version (uint32, keys.FORMAT_VERSION)
    12      32    namespace digest (raw sha256)
    44      32    key (raw)
    76      4     meta length M (uint32)
    80      8     payload length P (uint64)
    88      4     crc32 of meta + payload
    92      4     crc32 of bytes 0..91 (the header's own check)
    96      M     meta
    96+M    P     payload
A file is whole exactly when its size is 96 + M + P, both checks match and it names this store's
namespace, format version and the key of its file name.

Rule of a write: the bytes go to a temporary file (`TMP_PREFIX`...) in the entry's own folder, which is
exclusively flock'd while it is written, fsync'd, then renamed over the entry's name; the caller fsyncs
the folder. A temporary file whose lock is free belongs to a writer that died and may be removed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import struct
import threading
import zlib

from shared.state_store.keys import FORMAT_VERSION
from shared.state_store.store import StoredEntry

MAGIC = b"HYSSMST\x00"
_FIELDS = struct.Struct("<8sI32s32sIQI")
_CHECK = struct.Struct("<I")
HEADER_SIZE = _FIELDS.size + _CHECK.size
TMP_PREFIX = ".tmp-"
WRITE_CHUNK = 8 << 20
MAX_META = (1 << 32) - 1


class BadEntry(Exception):
    """The file exists but is not a whole entry of this store under this key; the message says why."""


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    namespace: str
    key: str
    meta_len: int
    payload_len: int
    crc: int

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.meta_len + self.payload_len


def entry_size(meta_len: int, payload_len: int) -> int:
    """The bytes an entry's file takes (what the store's capacity counts)."""
    return HEADER_SIZE + meta_len + payload_len


def pack_header(namespace: str, key: str, meta: memoryview, payload: memoryview) -> bytes:
    if meta.nbytes > MAX_META:
        raise ValueError(f"meta of {meta.nbytes} bytes exceeds {MAX_META}")
    crc = zlib.crc32(payload, zlib.crc32(meta))
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(namespace), bytes.fromhex(key), meta.nbytes,
                          payload.nbytes, crc)
    return fields + _CHECK.pack(zlib.crc32(fields))


def parse_header(raw: bytes) -> Header:
    if len(raw) < HEADER_SIZE:
        raise BadEntry(f"truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    fields = raw[:_FIELDS.size]
    (check,) = _CHECK.unpack_from(raw, _FIELDS.size)
    magic, version, namespace, key, meta_len, payload_len, crc = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise BadEntry("not a state-store entry (bad magic)")
    if zlib.crc32(fields) != check:
        raise BadEntry("header checksum mismatch")
    return Header(version, namespace.hex(), key.hex(), meta_len, payload_len, crc)


def check_header(header: Header, namespace: str, key: str, file_size: int) -> None:
    """BadEntry unless the header is this store's format, namespace and key and the file is whole."""
    if header.version != FORMAT_VERSION:
        raise BadEntry(f"format version {header.version}, this store reads {FORMAT_VERSION}")
    if header.namespace != namespace:
        raise BadEntry(f"names namespace {header.namespace}")
    if header.key != key:
        raise BadEntry(f"names key {header.key}")
    if file_size != header.file_size:
        raise BadEntry(f"{file_size} bytes, the header says {header.file_size}")


def read_header(path: str, namespace: str, key: str) -> Header:
    """The checked header of the file at `path` (payload unread). FileNotFoundError when it is gone."""
    with open(path, "rb") as f:
        header = parse_header(f.read(HEADER_SIZE))
        check_header(header, namespace, key, os.fstat(f.fileno()).st_size)
    return header


def read_entry(path: str, namespace: str, key: str) -> StoredEntry:
    """The checked entry at `path`; BadEntry when damaged, FileNotFoundError when it is gone."""
    with open(path, "rb") as f:
        header = parse_header(f.read(HEADER_SIZE))
        check_header(header, namespace, key, os.fstat(f.fileno()).st_size)
        meta = f.read(header.meta_len)
        payload = f.read(header.payload_len)
    if len(meta) != header.meta_len or len(payload) != header.payload_len:
        raise BadEntry("shorter than its header says")
    if zlib.crc32(payload, zlib.crc32(meta)) != header.crc:
        raise BadEntry("payload checksum mismatch")
    return StoredEntry(meta=meta, payload=payload)


class TempNames:
    """Unique temporary file names for this process's writes (pid, thread and a counter)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next(self, key: str) -> str:
        return f"{TMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}.{next(self._counter)}"


def _write_all(fd: int, data: memoryview) -> None:
    for start in range(0, data.nbytes, WRITE_CHUNK):
        chunk = data[start:start + WRITE_CHUNK]
        while chunk.nbytes:
            chunk = chunk[os.write(fd, chunk):]


def write_temp(tmp_path: str, header: bytes, meta: memoryview, payload: memoryview) -> int:
    """Write a whole entry to `tmp_path`, fsync'd and still flock'd; returns its open fd (the caller
    renames, then closes). On OSError the file is removed and the error raised."""
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _write_all(fd, memoryview(header + bytes(meta)))
        _write_all(fd, payload)
        os.fsync(fd)
    except BaseException:
        remove_quietly(tmp_path)
        os.close(fd)
        raise
    return fd


def remove_abandoned_temp(path: str) -> bool:
    """Remove a temporary file whose writer is gone (its flock is free); False when it is in use or gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return remove_quietly(path)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_quietly(path: str) -> bool:
    """Unlink `path`; False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
