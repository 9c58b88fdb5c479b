"""A second tier under a node's KV pool: committed blocks kept on local disk, found again by their chained
hash after the pool has evicted them, and still there when the node restarts.

    BlockManager.commit ──store(hash, tokens, parent, block)──> a copy of the block's K/V, held in memory
                                                               until the writer thread has put it on disk
    BlockManager.allocate / reserve: the pool misses block i ──contains──> load(hash, block) copies the
                                                               K/V back into a fresh pool block, which
                                                               is then a prefix hit like any other

One file per block, `<dir>/<model key>/<hash hex>.kvb`: a header (the model fingerprint, K/V dtype and
block shape, the block's hash, its parent's hash and its tokens, the payload's length and CRC-32) and
the block's K/V bytes. A load checks all of it: a flipped byte, a truncated file or a file of another
model is counted (`corrupt`), removed and recomputed, never served. The tier is bounded in bytes and
evicts its least recently used blocks. A failing disk never fails a request: a write that fails is
counted and dropped, a full disk stops writes for a while (`disabled_until`), a removed directory is
made again, and a file that has gone is a miss.

Thread safety: the engine thread calls `contains`, `store`, `load`; one writer thread writes and deletes
files. `_lock` guards the index; file I/O happens outside it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.kv_events import DISK
from pdserve.engine.prefix_hash import BlockHash

log = logging.getLogger(__name__)

MAGIC = b"PDSERVE-KV-BLOCK\n"
VERSION = 1
SUFFIX = ".kvb"
FULL_DISK_PAUSE_S = 30.0  # no writes for this long after the disk was full


@dataclass
class TierStats:
    """Counters of one tier (the node's metrics read them)."""

    stored: int = 0  # blocks handed to the tier (copied out of the pool)
    written: int = 0  # of those, put on disk
    loaded: int = 0  # blocks read back into the pool
    corrupt: int = 0  # files refused on load or at startup: bad bytes, truncated, another model's
    missing: int = 0  # files that had gone when a load wanted them
    write_errors: int = 0  # writes that failed (full disk, I/O error)
    evicted: int = 0  # blocks dropped to stay within the byte bound
    recovered: int = 0  # blocks found on disk at startup (a warm restart)


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    parent: BlockHash | None
    size: int  # bytes of its file
    payload: bytes | None = None  # the K/V while its write is pending (loads are served from it)


@dataclass(eq=False)
class _Pending:
    """A write for the writer thread: done only while `entry` is still the index's entry for the hash."""

    block_hash: BlockHash
    entry: _Entry
    header: bytes


class KVTier:
    """The disk tier of one KV pool (`kv_cache` [L, 2, NB, BS, Hkv, D]), at most `max_bytes` on disk.
    `store` and `load` change the index (and the pool block `load` writes into); the rest reads."""

    def __init__(self, directory: str | Path, max_bytes: int, *, fingerprint: str, kv_cache: torch.Tensor,
                 events: Callable[[bool, int, BlockHash], None] | None = None) -> None:
        """``events`` is told of each block the tier comes to hold (True) or stops holding (False), as
        (stored, DISK, hash) (engine.kv_events); from any thread."""
        if max_bytes <= 0:
            raise ValueError(f"the KV tier needs a positive byte bound, got {max_bytes}")
        self._kv = kv_cache
        self._events = events
        self._block_shape = tuple(kv_cache[:, :, 0].shape)  # [L, 2, BS, Hkv, D]
        self._dtype = str(kv_cache.dtype).removeprefix("torch.")
        self._payload_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self._fingerprint = fingerprint
        self.dir = Path(directory) / f"{fingerprint[:24]}-{self._dtype}-{self._block_shape[2]}"
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.disabled_until = 0.0  # monotonic time before which nothing is written (the disk was full)
        self._index: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._work: queue.Queue[_Pending | Path | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0  # queued work items not yet done
        self.dir.mkdir(parents=True, exist_ok=True)
        # One process per directory: another's files would look foreign or stray, and its deletions silent.
        self._lock_file = (self.dir / ".lock").open("a+b")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ValueError(f"KV tier directory {self.dir} is in use by another process; give each node its "
                             "own --kv-tier-dir") from None
        self._recover()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # ----------------------------------------------------------------------------------- state

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        """Bytes of the blocks in the index (on disk or pending)."""
        return self._bytes

    def header_bytes(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None,
                     checksum: int) -> bytes:
        meta = {"version": VERSION, "fingerprint": self._fingerprint, "dtype": self._dtype,
                "shape": list(self._block_shape), "hash": block_hash.hex(), "parent": parent.hex() if parent else None,
                "tokens": list(tokens), "payload_bytes": self._payload_bytes, "crc32": checksum}
        body = json.dumps(meta, separators=(",", ":")).encode()
        return MAGIC + len(body).to_bytes(4, "little") + body

    # ----------------------------------------------------------------------------------- engine side

    def contains(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None) -> bool:
        """Whether the tier holds this block with these tokens after this parent (a hash alone is no proof)."""
        with self._lock:
            entry = self._index.get(block_hash)
            return entry is not None and entry.parent == parent and entry.tokens == tuple(tokens)

    def store(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None, block_id: int) -> None:
        """Copies pool block `block_id` (committed: full, computed) for the writer; a block already held
        is only marked recently used. Nothing happens while the disk is full."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is not None:
                if entry.parent == parent and entry.tokens == tuple(tokens):
                    self._index.move_to_end(block_hash)
                    return
                self._drop(block_hash)  # a hash collision or a stale chain: the new content wins
            if time.monotonic() < self.disabled_until:
                return
        payload = self._kv[:, :, block_id].contiguous().view(torch.uint8).numpy().tobytes()
        header = self.header_bytes(block_hash, tokens, parent, zlib.crc32(payload))
        entry = _Entry(tuple(tokens), parent, len(header) + len(payload), payload)
        with self._lock:
            if block_hash in self._index:  # stored meanwhile (one engine thread: never, but cheap to keep)
                return
            self._added(block_hash, entry)
            self.stats.stored += 1
            self._outstanding += 1
            self._work.put(_Pending(block_hash, entry, header))
            self._evict_over_bound()

    def load(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None, block_id: int) -> bool:
        """Copies the tier's block into pool block `block_id`; False (the pool block untouched) when it is
        not there, or its file is gone or fails a check (then it is dropped and counted)."""
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or entry.parent != parent or entry.tokens != tuple(tokens):
                return False
            self._index.move_to_end(block_hash)
            payload = entry.payload
        if payload is None:
            payload = self._read(block_hash, tokens, parent)
            if payload is None:
                return False
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self._kv.dtype).view(self._block_shape)
        self._kv[:, :, block_id].copy_(src)
        self.stats.loaded += 1
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every pending write is on disk (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Flushes the pending writes and stops the writer."""
        self.flush()
        self._work.put(None)
        self._writer.join(timeout=30)
        self._lock_file.close()  # releases the directory

    def check_integrity(self) -> None:
        """Asserts the index's invariants: its byte count, the bound, and a file for every written block.
        Changes nothing (call with the writer idle: after `flush`)."""
        with self._lock:
            assert self._bytes == sum(e.size for e in self._index.values()), "tier bytes do not add up"
            assert self._bytes <= self.max_bytes, f"tier holds {self._bytes} bytes over its bound {self.max_bytes}"
            on_disk = {p.stem for p in self.dir.glob(f"*{SUFFIX}")} if self.dir.is_dir() else set()
            for block_hash, entry in self._index.items():
                if entry.payload is None and self.dir.is_dir():
                    assert block_hash.hex() in on_disk, f"tier block {block_hash.hex()} has no file"
            stray = on_disk - {h.hex() for h in self._index}
            assert not stray, f"tier files outside the index: {sorted(stray)[:3]}"

    # ----------------------------------------------------------------------------------- internals

    def _added(self, block_hash: BlockHash, entry: _Entry) -> None:
        """Puts an entry in the index (lock held)."""
        self._index[block_hash] = entry
        self._bytes += entry.size
        if self._events is not None:
            self._events(True, DISK, block_hash)

    def _removed(self, block_hash: BlockHash) -> _Entry:
        """Takes an entry out of the index (lock held); its file is the caller's business."""
        entry = self._index.pop(block_hash)
        self._bytes -= entry.size
        if self._events is not None:
            self._events(False, DISK, block_hash)
        return entry

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def _drop(self, block_hash: BlockHash) -> None:
        """Removes a block from the index (lock held) and has its file deleted."""
        self._removed(block_hash)
        self._outstanding += 1
        self._work.put(self._path(block_hash))

    def _lost_directory(self) -> None:
        """The directory was removed under the tier (lock held): every written block went with it."""
        gone = [h for h, e in self._index.items() if e.payload is None]
        for h in gone:
            self._removed(h)
        if gone:
            log.warning("KV tier %s: the directory was removed; %d blocks lost (recomputed when needed)", self.dir,
                        len(gone))

    def _evict_over_bound(self) -> None:
        while self._bytes > self.max_bytes and self._index:
            self._drop(next(iter(self._index)))
            self.stats.evicted += 1

    def _corrupt(self, block_hash: BlockHash, why: str) -> None:
        log.warning("KV tier: block %s refused (%s); it will be recomputed", block_hash.hex()[:12], why)
        self.stats.corrupt += 1
        with self._lock:
            if block_hash in self._index:
                self._drop(block_hash)

    def _parse(self, data: bytes) -> tuple[dict, int] | None:
        """The header of a block file's bytes and the payload's offset; None when it is not one."""
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return None
        n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        start = len(MAGIC) + 4
        try:
            meta = json.loads(data[start:start + n])
        except ValueError:
            return None
        return (meta, start + n) if isinstance(meta, dict) else None

    def _foreign(self, meta: dict) -> str | None:
        """Why a header does not belong to this pool's blocks (None: it does)."""
        for key, want in (("version", VERSION), ("fingerprint", self._fingerprint), ("dtype", self._dtype),
                          ("shape", list(self._block_shape)), ("payload_bytes", self._payload_bytes)):
            if meta.get(key) != want:
                return f"{key} {meta.get(key)!r}, expected {want!r}"
        return None

    def _read(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None) -> bytes | None:
        try:
            data = self._path(block_hash).read_bytes()
        except FileNotFoundError:
            self.stats.missing += 1
            with self._lock:
                if block_hash in self._index:
                    self._removed(block_hash)
                if not self.dir.is_dir():
                    self._lost_directory()
            return None
        except OSError as err:
            self._corrupt(block_hash, f"unreadable: {err}")
            return None
        parsed = self._parse(data)
        if parsed is None:
            self._corrupt(block_hash, "not a KV block file")
            return None
        meta, offset = parsed
        why = self._foreign(meta)
        if why is None and (meta.get("hash") != block_hash.hex() or meta.get("tokens") != list(tokens)
                            or meta.get("parent") != (parent.hex() if parent else None)):
            why = "its hash, tokens or parent differ from the index"
        payload = data[offset:]
        if why is None and len(payload) != self._payload_bytes:
            why = f"truncated: {len(payload)} of {self._payload_bytes} payload bytes"
        if why is None and zlib.crc32(payload) != meta.get("crc32"):
            why = "checksum mismatch"
        if why is not None:
            self._corrupt(block_hash, why)
            return None
        return payload

    def _recover(self) -> None:
        """Indexes the block files already in the directory (a restarted node's tier), oldest first;
        removes what is not a block of this pool, and leftovers of interrupted writes."""
        files = []
        for path in self.dir.iterdir():
            if path.name == ".lock":
                continue
            if path.suffix != SUFFIX:
                path.unlink(missing_ok=True)  # an interrupted write's temporary file
                continue
            try:
                files.append((path.stat().st_mtime, path))
            except OSError:
                continue
        for _, path in sorted(files):
            try:
                with path.open("rb") as f:
                    head = f.read(1 << 16)
                size = path.stat().st_size
            except OSError:
                continue
            parsed = self._parse(head)
            why = "not a KV block file" if parsed is None else self._foreign(parsed[0])
            if why is None:
                meta, offset = parsed  # type: ignore[misc]
                if size != offset + self._payload_bytes or meta.get("hash") != path.stem:
                    why = "truncated or misnamed"
            if why is not None:
                log.warning("KV tier: %s removed at startup (%s)", path.name, why)
                self.stats.corrupt += 1
                path.unlink(missing_ok=True)
                continue
            parent = bytes.fromhex(meta["parent"]) if meta.get("parent") else None
            with self._lock:
                self._added(bytes.fromhex(path.stem), _Entry(tuple(meta["tokens"]), parent, size))
            self.stats.recovered += 1
        with self._lock:
            self._evict_over_bound()
        if self.stats.recovered:
            log.info("KV tier %s: %d blocks (%.1f MiB) from an earlier run", self.dir, self.stats.recovered,
                     self._bytes / 2**20)

    def _write_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            try:
                if isinstance(item, Path):
                    item.unlink(missing_ok=True)
                else:
                    self._write(item)
            except Exception:  # a tier never takes the node down
                log.exception("KV tier: writer error")
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _write(self, item: _Pending) -> None:
        entry = item.entry
        with self._lock:
            payload = entry.payload if self._index.get(item.block_hash) is entry else None
        if payload is None:
            return  # dropped (evicted, replaced) before its turn
        path = self._path(item.block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            try:
                self._write_file(tmp, path, item.header, payload)
            except FileNotFoundError:  # the directory was removed under us: make it again, once
                with self._lock:
                    self._lost_directory()
                self.dir.mkdir(parents=True, exist_ok=True)
                self._write_file(tmp, path, item.header, payload)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            self.stats.write_errors += 1
            if err.errno == errno.ENOSPC:
                self.disabled_until = time.monotonic() + FULL_DISK_PAUSE_S
                log.warning("KV tier %s: the disk is full; no writes for %.0f s (blocks are recomputed)", self.dir,
                            FULL_DISK_PAUSE_S)
            else:
                log.warning("KV tier %s: a write failed: %s", self.dir, err)
            with self._lock:
                if self._index.get(item.block_hash) is entry:
                    self._removed(item.block_hash)
            return
        with self._lock:
            if self._index.get(item.block_hash) is entry:
                entry.payload = None  # served from disk from now on
                self.stats.written += 1
            else:
                path.unlink(missing_ok=True)  # dropped while it was being written

    @staticmethod
    def _write_file(tmp: Path, path: Path, header: bytes, payload: bytes) -> None:
        with tmp.open("wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
