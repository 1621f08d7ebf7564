"""A shared-memory broadcast queue: one writer, N readers, every reader gets every message in order.

The EngineCore writes each step's `WorkerCommand` once; every tensor-parallel worker reads it.
The ring is `num_slots` fixed-size slots in one file under /dev/shm. Each slot starts with a
header (payload length, "more chunks follow"); a message bigger than a slot is split over
consecutive slots and reassembled by the readers, so a several-MB `SchedulerOutput` fits a small
ring (Kubernetes pods often get a 64 MiB /dev/shm).

Flow control is two semaphores per reader, so a blocked side sleeps in the kernel rather than
spinning (on a 2-core machine a spinning loop halves model throughput):
- `space[r]` starts at `num_slots`: the writer takes one before overwriting a slot, reader `r`
  gives it back once it has copied the slot out;
- `avail[r]` starts at 0: the writer gives one after writing a slot, reader `r` takes it before
  reading.
Each side keeps its slot index to itself; a semaphore post/wait is a memory barrier, so the slot
bytes written before a post are visible after the matching wait and no shared counters are needed.

Waits are cut into slices; between slices the caller's `check()` runs, so a side whose peer
died raises instead of hanging forever.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import secrets
import struct
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Payload length (uint32), "more chunks follow" flag (uint8), padding to 8 bytes.
_HEADER = struct.Struct("<IB3x")
HEADER_BYTES = _HEADER.size
# How long one semaphore wait lasts before `check()` runs: short enough to notice a dead peer
# quickly, long enough that an idle process wakes only twice a second.
WAIT_SLICE_S = 0.5


@dataclass(frozen=True)
class ShmQueueHandle:
    """What a reader needs to attach; picklable while spawning (pass it as a Process argument)."""

    path: str
    num_readers: int
    num_slots: int
    slot_bytes: int
    space: tuple[Any, ...]  # multiprocessing semaphores, one per reader
    avail: tuple[Any, ...]

    @property
    def payload_bytes(self) -> int:
        """Bytes of message one slot carries, after its header."""
        return self.slot_bytes - HEADER_BYTES

    @property
    def size(self) -> int:
        """Bytes of the whole shared-memory file."""
        return self.num_slots * self.slot_bytes


def _shm_dir() -> str:
    # /dev/shm is tmpfs on Linux; elsewhere the temp dir still works, just not RAM-backed.
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _unlink_quietly(path: str) -> None:
    # Already gone is fine: the name only has to end, whoever removed it.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _acquire(
    sem: Any, deadline: float | None = None, check: Callable[[], None] | None = None
) -> bool:
    """Take `sem`, sleeping in slices and running `check()` between them; False past `deadline`."""
    while True:
        wait = WAIT_SLICE_S
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return sem.acquire(block=False)
        if sem.acquire(timeout=wait):
            return True
        if check is not None:
            check()


class ShmBroadcastQueue:
    """The writer side: creates the ring and its semaphores, and broadcasts messages."""

    def __init__(self, handle: ShmQueueHandle, mm: mmap.mmap) -> None:
        self.handle = handle
        self._mm = mm
        self._next_slot = 0
        # Unlinks at garbage collection or interpreter exit too, should the owner raise before
        # calling unlink() (only SIGKILL before unlink() can leave the file behind).
        self._unlinker = weakref.finalize(self, _unlink_quietly, handle.path)
        self._closed = False

    @classmethod
    def create(
        cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20, ctx: Any = None
    ) -> ShmBroadcastQueue:
        """Create the shared-memory file and semaphores for `num_readers` readers."""
        if num_readers < 1 or num_slots < 1:
            raise ValueError(
                f"need at least one reader and one slot; got {num_readers} readers, "
                f"{num_slots} slots"
            )
        if slot_bytes <= HEADER_BYTES:
            raise ValueError(
                f"slot_bytes is {slot_bytes}; it must exceed the {HEADER_BYTES}-byte header"
            )
        ctx = ctx or multiprocessing.get_context("spawn")
        path = os.path.join(_shm_dir(), f"tidegate-shm-{os.getpid()}-{secrets.token_hex(6)}")
        handle = ShmQueueHandle(
            path=path,
            num_readers=num_readers,
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            space=tuple(ctx.Semaphore(num_slots) for _ in range(num_readers)),
            avail=tuple(ctx.Semaphore(0) for _ in range(num_readers)),
        )
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, handle.size)
            mm = mmap.mmap(fd, handle.size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(handle, mm)

    def enqueue(self, data: bytes, check: Callable[[], None] | None = None) -> None:
        """Broadcast `data`, blocking while any reader still holds the slots it needs.

        If `check` raises mid-message the readers may hold a partial message: treat the queue
        as broken (it is meant for "a peer died, shut down").
        """
        h = self.handle
        view = memoryview(data).cast("B")
        step = h.payload_bytes
        # range() yields nothing for an empty message; it still needs one (empty) slot.
        starts = range(0, len(view), step) or range(1)
        for start in starts:
            chunk = view[start : start + step]
            for sem in h.space:
                _acquire(sem, check=check)
            offset = self._next_slot * h.slot_bytes
            more = start + step < len(view)
            _HEADER.pack_into(self._mm, offset, len(chunk), more)
            self._mm[offset + HEADER_BYTES : offset + HEADER_BYTES + len(chunk)] = chunk
            self._next_slot = (self._next_slot + 1) % h.num_slots
            for sem in h.avail:
                sem.release()

    def unlink(self) -> None:
        """Remove the file's name (call once every reader has attached); idempotent."""
        self._unlinker()

    def close(self) -> None:
        """Unlink and unmap; idempotent."""
        self.unlink()
        if not self._closed:
            self._closed = True
            self._mm.close()


class ShmBroadcastReader:
    """One reader (`rank`) of a broadcast queue, attached by the handle's path."""

    def __init__(self, handle: ShmQueueHandle, rank: int) -> None:
        if not 0 <= rank < handle.num_readers:
            raise ValueError(
                f"rank {rank} is out of range; the queue has {handle.num_readers} readers"
            )
        self.handle = handle
        self.rank = rank
        with open(handle.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), handle.size, access=mmap.ACCESS_READ)
        self._next_slot = 0
        # Chunks of a message not yet complete survive a timeout, so the next call resumes it.
        self._chunks: list[bytes] = []
        self._closed = False

    def dequeue(
        self, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> bytes:
        """Return the next message; TimeoutError if `timeout` seconds pass without one."""
        h = self.handle
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not _acquire(h.avail[self.rank], deadline, check):
                raise TimeoutError(f"no message on the shared-memory queue within {timeout} s")
            offset = self._next_slot * h.slot_bytes
            length, more = _HEADER.unpack_from(self._mm, offset)
            self._chunks.append(self._mm[offset + HEADER_BYTES : offset + HEADER_BYTES + length])
            self._next_slot = (self._next_slot + 1) % h.num_slots
            h.space[self.rank].release()
            if not more:
                chunks, self._chunks = self._chunks, []
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        """Unmap the ring; idempotent."""
        if not self._closed:
            self._closed = True
            self._mm.close()
