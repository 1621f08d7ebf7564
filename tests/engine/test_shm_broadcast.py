"""The shared-memory broadcast queue, with real reader processes started by spawn."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import random
import threading
import time

import pytest

from tidegate.engine.distributed.shm_broadcast import (
    WAIT_SLICE_S,
    ShmBroadcastQueue,
    ShmBroadcastReader,
)

SPAWN = multiprocessing.get_context("spawn")
# Generous: a hung test fails here instead of hanging CI.
DEADLINE_S = 30.0


# -- child-process targets (module level: spawn pickles them by name) ----------------------


def digest_reader(handle, rank, count, attached, start, results) -> None:
    """Attach, wait for `start`, read `count` messages, send back their sha256 digests."""
    reader = ShmBroadcastReader(handle, rank)
    attached.set()
    start.wait(DEADLINE_S)
    digests = [hashlib.sha256(reader.dequeue(timeout=DEADLINE_S)).hexdigest() for _ in range(count)]
    reader.close()
    results.put((rank, digests))


def idle_reader(handle, wait_s, results) -> None:
    """Block in dequeue on an empty queue for `wait_s` and report the CPU time that cost."""
    reader = ShmBroadcastReader(handle, 0)
    cpu_before = time.process_time()
    with contextlib.suppress(TimeoutError):
        reader.dequeue(timeout=wait_s)
    results.put(time.process_time() - cpu_before)
    reader.close()


# -- helpers --------------------------------------------------------------------------------


def start_readers(target, args_per_reader) -> list:
    """Start one spawned process per argument tuple."""
    procs = [SPAWN.Process(target=target, args=args, daemon=True) for args in args_per_reader]
    for proc in procs:
        proc.start()
    return procs


def stop(procs) -> None:
    """Join readers that finished; kill any that did not."""
    for proc in procs:
        proc.join(DEADLINE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def fail_if_dead(procs) -> None:
    """A `check` for the writer: a reader that exited early means nobody will free slots."""
    for proc in procs:
        if proc.exitcode is not None:
            raise RuntimeError(f"reader {proc.pid} exited with {proc.exitcode}")


# -- tests ----------------------------------------------------------------------------------


def test_every_reader_gets_every_message_in_order_byte_identical():
    queue = ShmBroadcastQueue.create(num_readers=2, num_slots=8, slot_bytes=4096)
    payload = queue.handle.payload_bytes
    rng = random.Random(0)
    # Sizes from empty through several slots, including the exact slot boundaries.
    sizes = [0, 1, payload - 1, payload, payload + 1, 2 * payload, int(3.5 * payload)]
    sizes += [rng.randrange(0, int(3.5 * payload) + 1) for _ in range(500 - len(sizes))]
    messages = [rng.randbytes(n) for n in sizes]
    attached = [SPAWN.Event() for _ in range(2)]
    start = SPAWN.Event()
    results = SPAWN.Queue()
    procs = start_readers(
        digest_reader,
        [(queue.handle, r, len(messages), attached[r], start, results) for r in range(2)],
    )
    try:
        for event in attached:
            assert event.wait(DEADLINE_S)
        queue.unlink()
        assert not os.path.exists(queue.handle.path)
        start.set()
        for message in messages:
            queue.enqueue(message, check=lambda: fail_if_dead(procs))
        got = dict(results.get(timeout=DEADLINE_S) for _ in procs)
    finally:
        stop(procs)
        queue.close()
    expected = [hashlib.sha256(m).hexdigest() for m in messages]
    assert got[0] == expected
    assert got[1] == expected


def test_writer_blocks_instead_of_overwriting_slots_a_slow_reader_has_not_read():
    queue = ShmBroadcastQueue.create(num_readers=1, num_slots=4, slot_bytes=256)
    messages = [bytes([i]) * 200 for i in range(12)]
    attached, start, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    procs = start_readers(
        digest_reader, [(queue.handle, 0, len(messages), attached, start, results)]
    )
    blocked_at: list[int] = []

    def release_reader_once_blocked() -> None:
        # `check` runs only after a full wait slice without free space: the writer is blocked.
        if not blocked_at:
            blocked_at.append(sent)
            start.set()
        fail_if_dead(procs)

    sent = 0
    try:
        assert attached.wait(DEADLINE_S)
        for message in messages:
            queue.enqueue(message, check=release_reader_once_blocked)
            sent += 1
        _, digests = results.get(timeout=DEADLINE_S)
    finally:
        stop(procs)
        queue.close()
    assert blocked_at == [4], "the writer should block on the 5th message of a 4-slot ring"
    assert digests == [hashlib.sha256(m).hexdigest() for m in messages]


def test_a_reader_waiting_on_an_empty_queue_sleeps_instead_of_spinning():
    queue = ShmBroadcastQueue.create(num_readers=1, slot_bytes=4096)
    results = SPAWN.Queue()
    procs = start_readers(idle_reader, [(queue.handle, 1.0, results)])
    try:
        cpu_s = results.get(timeout=DEADLINE_S)
    finally:
        stop(procs)
        queue.close()
    assert cpu_s < 0.1


def test_dequeue_on_an_empty_queue_times_out():
    queue = ShmBroadcastQueue.create(num_readers=1, slot_bytes=4096)
    reader = ShmBroadcastReader(queue.handle, 0)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.2)
        assert 0.15 < time.monotonic() - started < 0.2 + WAIT_SLICE_S
    finally:
        reader.close()
        queue.close()


class PeerDied(Exception):
    pass


def test_a_failing_check_ends_a_blocked_dequeue():
    queue = ShmBroadcastQueue.create(num_readers=1, slot_bytes=4096)
    reader = ShmBroadcastReader(queue.handle, 0)

    def peer_is_dead() -> None:
        raise PeerDied("the writer is gone")

    try:
        with pytest.raises(PeerDied):
            reader.dequeue(check=peer_is_dead)
    finally:
        reader.close()
        queue.close()


def test_readers_keep_reading_after_the_name_is_unlinked():
    queue = ShmBroadcastQueue.create(num_readers=1, slot_bytes=4096)
    reader = ShmBroadcastReader(queue.handle, 0)
    try:
        queue.unlink()
        queue.unlink()
        assert not os.path.exists(queue.handle.path)
        queue.enqueue(b"still here")
        assert reader.dequeue(timeout=1) == b"still here"
    finally:
        reader.close()
        queue.close()
        queue.close()


def test_a_message_bigger_than_the_whole_default_ring_streams_through_it():
    queue = ShmBroadcastQueue.create(num_readers=1)
    reader = ShmBroadcastReader(queue.handle, 0)
    queue.unlink()
    message = random.Random(1).randbytes(3 * queue.handle.size + 12345)
    received: list[bytes] = []
    thread = threading.Thread(target=lambda: received.append(reader.dequeue(timeout=DEADLINE_S)))
    thread.start()
    try:
        queue.enqueue(message)
        thread.join(DEADLINE_S)
    finally:
        reader.close()
        queue.close()
    assert received == [message]
