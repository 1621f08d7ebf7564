"""A client that goes away gets its engine requests aborted, whatever phase it left in."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.engine.entrypoints.fake_engine import MODEL
from tidegate.engine.entrypoints.openai.async_iterators import merge_async_iterators

TIMEOUT_S = 5.0


async def call_until_disconnect(
    app: Any,
    path: str,
    body: dict[str, Any],
    disconnect: asyncio.Event,
    stop_reading: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    """Drive the ASGI app as a server would; the client disconnects when `disconnect` is set.

    With `stop_reading`, the client reads one body chunk and no more: the next send blocks
    (as a full socket buffer does) and `stop_reading` is set.
    """
    payload = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if stop_reading is not None and len(sent) == 2:
            stop_reading.set()
            await asyncio.get_running_loop().create_future()  # until cancelled
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # what uvicorn declares
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return sent


def run_and_disconnect(app, engine, path: str, body: dict[str, Any], holding: int):
    """Send the request, disconnect once `holding` sub-requests wait in the engine."""

    async def main() -> list[dict[str, Any]]:
        disconnect = asyncio.Event()
        call = asyncio.ensure_future(call_until_disconnect(app, path, body, disconnect))
        await engine.wait_holding(holding)
        disconnect.set()
        sent = await asyncio.wait_for(call, TIMEOUT_S)
        # Aborted by the time the response is done, not later when the loop shuts down.
        assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
        return sent

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "num_requests"), [("/v1/completions", 4), ("/v1/chat/completions", 2)]
)
def test_disconnect_aborts_a_non_streaming_request(app, engine, path, num_requests):
    engine.hold_after = 1
    body = {
        "model": MODEL,
        "prompt": ["a", "b"],
        "messages": [{"role": "user", "content": "x"}],
        "n": 2,
    }
    sent = run_and_disconnect(app, engine, path, body, holding=num_requests)
    assert len(engine.submitted) == num_requests
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
    assert sent[0]["status"] == 499


def test_disconnect_before_the_first_token_aborts_a_stream(app, engine):
    engine.hold_after = 0
    body = {"model": MODEL, "prompt": "a", "n": 3, "stream": True}
    sent = run_and_disconnect(app, engine, "/v1/completions", body, holding=3)
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
    assert len(engine.aborted) == 3
    assert sent[0]["status"] == 499


def test_disconnect_mid_stream_aborts_every_choice(app, engine):
    engine.hold_after = 2
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}
    sent = run_and_disconnect(app, engine, "/v1/chat/completions", body, holding=2)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    streamed = b"".join(m.get("body", b"") for m in sent[1:])
    assert streamed.startswith(b"data: ") and b"[DONE]" not in streamed
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
    assert len(engine.aborted) == 2


def test_disconnect_of_a_client_that_stopped_reading_aborts_every_choice(app, engine):
    body = {"model": MODEL, "prompt": "a", "n": 2, "stream": True}

    async def main() -> list[dict[str, Any]]:
        disconnect, stop_reading = asyncio.Event(), asyncio.Event()
        call = asyncio.ensure_future(
            call_until_disconnect(app, "/v1/completions", body, disconnect, stop_reading)
        )
        await asyncio.wait_for(stop_reading.wait(), TIMEOUT_S)
        disconnect.set()
        sent = await asyncio.wait_for(call, TIMEOUT_S)
        # Aborted by the time the response is done, not later when the loop shuts down.
        assert sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 200 and len(sent) == 2
    assert len(engine.aborted) == 2


def test_finished_requests_are_not_aborted(api, engine):
    api.post("/v1/completions", {"model": MODEL, "prompt": "a", "n": 2, "max_tokens": 3})
    api.post("/v1/completions", {"model": MODEL, "prompt": "a", "stream": True})
    assert len(engine.submitted) == 3 and engine.aborted == []


# ---------------------------------------------------------------- merge_async_iterators


class Source:
    """An async iterator of `items` that records whether it was closed before its end."""

    def __init__(self, items: list[Any], fail_at: int | None = None, hang_at: int | None = None):
        self.items, self.fail_at, self.hang_at = items, fail_at, hang_at
        self.closed_early = False
        self.hanging = asyncio.Event()
        self.iterator = self._run()

    async def _run(self) -> AsyncIterator[Any]:
        try:
            for i, item in enumerate(self.items):
                if i == self.fail_at:
                    raise RuntimeError(f"source failed at {i}")
                if i == self.hang_at:
                    self.hanging.set()
                    await asyncio.get_running_loop().create_future()
                await asyncio.sleep(0)
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_early = True
            raise


def test_merge_yields_every_item_tagged_with_its_source():
    async def main():
        sources = [Source(["a", "b", "c"]), Source([1, 2]), Source([])]
        return [pair async for pair in merge_async_iterators([s.iterator for s in sources])]

    pairs = asyncio.run(main())
    assert [item for index, item in pairs if index == 0] == ["a", "b", "c"]
    assert [item for index, item in pairs if index == 1] == [1, 2]
    assert len(pairs) == 5
    assert [index for index, _ in pairs[:2]] == [0, 1]  # interleaved, not one after the other


def test_merge_closes_every_source_when_one_fails():
    sources = [Source([1, 2, 3], hang_at=1), Source([1, 2], fail_at=1), Source([1, 2, 3])]

    async def main():
        async for _ in merge_async_iterators([s.iterator for s in sources]):
            pass

    with pytest.raises(RuntimeError, match="source failed at 1"):
        asyncio.run(main())
    assert [s.closed_early for s in sources] == [True, False, True]


def test_merge_closes_every_source_when_the_consumer_stops():
    sources = [Source([1, 2, 3]), Source([1, 2, 3], hang_at=1)]

    async def main():
        merged = merge_async_iterators([s.iterator for s in sources])
        await merged.__anext__()
        await merged.aclose()

    asyncio.run(main())
    assert [s.closed_early for s in sources] == [True, True]


def test_merge_closes_every_source_when_the_consumer_is_cancelled():
    sources = [Source([1, 2, 3], hang_at=1), Source([1, 2, 3], hang_at=1)]

    async def main():
        merged = merge_async_iterators([s.iterator for s in sources])

        async def consume():
            async for _ in merged:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(asyncio.gather(*(s.hanging.wait() for s in sources)), TIMEOUT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [s.closed_early for s in sources] == [True, True]
