"""Several async iterators consumed as one, closed together however the consumer stops.

An API request with n > 1 or a batch of prompts becomes several engine requests; closing an
engine iterator early is what aborts its request, so every exit path here closes them all.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Generic, TypeVar

import anyio

T = TypeVar("T")
logger = logging.getLogger(__name__)

_END: Any = object()


async def _next(iterator: AsyncIterator[T]) -> T:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return _END


async def aclose_all(
    iterators: Sequence[AsyncIterator[Any]], tasks: Sequence[asyncio.Task]
) -> None:
    """Cancel tasks still waiting on the iterators, then close every iterator."""
    for task in tasks:
        task.cancel()
    # Starlette cancels a streaming response through an anyio scope, which re-cancels every
    # await inside it; shield the cleanup so that it finishes.
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in iterators:
            close = getattr(iterator, "aclose", None)
            if close is None:
                continue
            try:
                await close()
            except Exception:
                logger.exception("closing an engine output stream failed")


async def first_items(iterators: Sequence[AsyncIterator[T]]) -> list[T]:
    """The first item of every iterator, awaited concurrently; if any fails, all are closed."""
    tasks = [asyncio.ensure_future(_next(iterator)) for iterator in iterators]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await aclose_all(iterators, tasks)
        raise


class MergedIterators(Generic[T]):
    """(index, item) pairs from several iterators in arrival order; `aclose` closes them all.

    One iterator (one prompt, n=1: most requests) is awaited directly; several need a task
    each to wait on them together.
    """

    def __init__(self, iterators: Sequence[AsyncIterator[T]], firsts: Sequence[T] | None) -> None:
        self._iterators = list(iterators)
        self._ready: collections.deque[tuple[int, T]] = collections.deque()
        self._pending: dict[asyncio.Task, int] = {}
        self._started = False
        self._closed = False
        if firsts is not None:
            self._ready.extend((i, item) for i, item in enumerate(firsts) if item is not _END)
            self._live = [item is not _END for item in firsts]
        else:
            self._live = [True] * len(self._iterators)

    def __aiter__(self) -> MergedIterators[T]:
        return self

    async def __anext__(self) -> tuple[int, T]:
        if self._closed:
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            for index, live in enumerate(self._live):
                if live:
                    self._schedule(index)
        if len(self._iterators) == 1 and not self._ready:
            return await self._next_alone()
        try:
            while not self._ready:
                if not self._pending:
                    self._closed = True
                    raise StopAsyncIteration
                done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=self._pending.__getitem__):
                    index = self._pending.pop(task)
                    item = task.result()  # an iterator's error ends the merge (after cleanup)
                    if item is not _END:
                        self._ready.append((index, item))
                        self._schedule(index)
        except StopAsyncIteration:
            raise
        except BaseException:
            await self.aclose()
            raise
        return self._ready.popleft()

    async def _next_alone(self) -> tuple[int, T]:
        if not self._live[0]:
            self._closed = True
            raise StopAsyncIteration
        try:
            item = await _next(self._iterators[0])
        except BaseException:
            await self.aclose()
            raise
        if item is _END:
            self._closed = True
            raise StopAsyncIteration
        return 0, item

    async def next_batch(self) -> list[tuple[int, T]]:
        """Every pair ready now, waiting only while none is; [] once every iterator ended."""
        try:
            first = await self.__anext__()
        except StopAsyncIteration:
            return []
        batch = [first, *self._ready]
        self._ready.clear()
        return batch

    def _schedule(self, index: int) -> None:
        if len(self._iterators) == 1:
            return  # awaited directly
        task = asyncio.ensure_future(_next(self._iterators[index]))
        self._pending[task] = index

    async def aclose(self) -> None:
        """Stop waiting and close every iterator (aborting unfinished engine requests)."""
        self._closed = True
        tasks = list(self._pending)
        self._pending.clear()
        await aclose_all(self._iterators, tasks)


def merge_async_iterators(
    iterators: Sequence[AsyncIterator[T]], firsts: Sequence[T] | None = None
) -> MergedIterators[T]:
    """Merge iterators; `firsts` are items already taken from each (see `first_items`)."""
    return MergedIterators(iterators, firsts)
