"""The engine core's side of structured outputs: compiles off the step loop, caches, fills masks."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.structured_output.backend import (
    GrammarMatcher,
    StructuredOutputBackend,
    bitmask_words,
)

# A failed compile answers identical requests this long, then is forgotten (a client retrying a
# bad schema gets its error at once; a stream of distinct bad schemas pins nothing).
FAILED_COMPILE_TTL_S = 60.0


class StructuredOutputManager:
    """Compiles grammars off the step loop (a small thread pool), caches compiled grammars by
    StructuredOutputsParams.key (LRU, bounded), and fills bitmasks."""

    def __init__(
        self,
        backend: StructuredOutputBackend,
        max_cached_grammars: int = 256,
        num_compile_threads: int = 1,
    ) -> None:
        if max_cached_grammars < 1 or num_compile_threads < 1:
            raise ValueError(
                "max_cached_grammars and num_compile_threads must be at least 1 "
                f"(got {max_cached_grammars} and {num_compile_threads})"
            )
        self.backend = backend
        self.max_cached_grammars = max_cached_grammars
        self._pool = ThreadPoolExecutor(num_compile_threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._failed_at: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @property
    def cache_hits(self) -> int:
        """compile_async calls answered from the cache."""
        return self._hits

    @property
    def cache_misses(self) -> int:
        """compile_async calls that started a compile."""
        return self._misses

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar; the same future for the same key while cached."""
        key = params.key
        with self._lock:
            now = time.monotonic()
            self._forget_old_failures(now)
            future = self._cache.get(key)
            if future is not None:
                if _failed(future):  # its done-callback may not have run yet
                    self._failed_at.setdefault(key, now)
                self._cache.move_to_end(key)
                self._hits += 1
                return future
            self._misses += 1
            future = self._pool.submit(self.backend.compile, params)
            self._cache[key] = future
            while len(self._cache) > self.max_cached_grammars:
                evicted, _ = self._cache.popitem(last=False)
                self._failed_at.pop(evicted, None)
        future.add_done_callback(lambda done: self._on_done(key, done))
        return future

    def _on_done(self, key: tuple[str, str], future: Future) -> None:
        if _failed(future):
            with self._lock:
                if self._cache.get(key) is future:
                    self._failed_at.setdefault(key, time.monotonic())

    def _forget_old_failures(self, now: float) -> None:
        """Drop failed compiles older than FAILED_COMPILE_TTL_S (the caller holds the lock)."""
        for key in [k for k, at in self._failed_at.items() if now - at >= FAILED_COMPILE_TTL_S]:
            del self._failed_at[key]
            self._cache.pop(key, None)

    def new_matcher(self, compiled: object) -> GrammarMatcher:
        """A matcher at the start of a compiled grammar."""
        return self.backend.new_matcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """An int32 bitmask of num_rows rows (every token allowed until filled)."""
        return np.full((num_rows, bitmask_words(self.backend.vocab_size)), -1, dtype=np.int32)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Fill row i of bitmask for matchers[i] (the library's threads for large batches)."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or len(bitmask) < len(matchers):
            raise ValueError(
                f"bitmask must be int32 with at least {len(matchers)} rows, got "
                f"{bitmask.dtype} of shape {bitmask.shape}"
            )
        self.backend.fill_bitmasks(matchers, bitmask)

    def shutdown(self) -> None:
        """Stop the compile threads; compiles not yet started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _failed(future: Future) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)
