"""A scripted engine with the interface of AsyncLLM, and helpers to call the API app."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from tidegate.engine.errors import EngineDeadError, EngineOverloadedError
from tidegate.engine.input_processor import InputProcessor
from tidegate.engine.messages import EngineCoreRequest
from tidegate.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tidegate.engine.tokenizer import Tokenizer

MODEL = "tiny"
MAX_MODEL_LEN = 64
# Every request "generates" this text, one token per output, cut at max_tokens.
SCRIPT = " the cat sat on the mat and looked at the dog."
# The size of the vectors embedding requests get.
EMBEDDING_SIZE = 8


def pooled_values(ids: list[int], size: int = EMBEDDING_SIZE) -> list[float]:
    """What the scripted engine pools for a prompt (`size` values: EMBEDDING_SIZE for an
    embedding, a classifier's labels): the prompt's length, then its first ids, then zeros."""
    values = [float(len(ids)), *map(float, ids[: size - 1])][:size]
    return values + [0.0] * (size - len(values))


class FakeEngine:
    """The interface AsyncLLM gives the API server, generating SCRIPT instead of running a model."""

    def __init__(self, tokenizer: Tokenizer, input_processor: InputProcessor) -> None:
        self.tokenizer = tokenizer
        self.input_processor = input_processor
        self.max_model_len = input_processor.max_model_len
        self.kv_role = "none"
        self.is_dead = False
        self.dead_reason: str | None = None
        self.script_ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.cached_tokens = 0
        # What happened, for tests to check.
        self.submitted: list[EngineCoreRequest] = []
        self.aborted: list[str] = []  # iterators closed or cancelled before they finished
        self.abort_calls: list[str] = []
        self.num_holding = 0
        # What to do: refuse requests past the first `admit`; die after `die_after` outputs
        # (only requests whose id ends with `die_suffix`); wait forever after `hold_after`
        # outputs; show no text at `held_back_steps` (it comes with the next output, as when
        # the engine holds back what may be the start of a stop string).
        self.admit: int | None = None
        self.die_after: int | None = None
        self.die_suffix = ""
        self.hold_after: int | None = None
        self.held_back_steps: set[int] = set()
        # Outputs handed over per item, as when the consumer fell that many steps behind.
        self.steps_per_item = 1
        # Texts to generate instead of SCRIPT: choice i (engine id "...-<i>") gets texts[i].
        self.texts: list[str] | None = None
        # Values of a pooling request's output (a classifier's: its number of labels).
        self.pooled_size = EMBEDDING_SIZE

    async def generate(
        self, request: EngineCoreRequest, prompt: str | None = None
    ) -> AsyncIterator[list[RequestOutput]]:
        self.submitted.append(request)
        # What AsyncLLM sends to the engine-core process must encode (64-bit integers only).
        msgspec.msgpack.encode(request)
        try:
            if self.admit is not None and len(self.submitted) > self.admit:
                raise EngineOverloadedError("the waiting queue is full", retry_after_s=7)
            queued: list[RequestOutput] = []
            async for output in self._script(request, prompt):
                queued.append(output)
                if len(queued) == self.steps_per_item or output.finished:
                    yield queued
                    queued = []
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.append(request.request_id)
            raise

    async def _script(
        self, request: EngineCoreRequest, prompt: str | None
    ) -> AsyncIterator[RequestOutput]:
        params = request.sampling_params
        ids = self._script_ids(request)[: params.max_tokens]
        shown = 0
        for step, token_id in enumerate(ids):
            dies = request.request_id.endswith(self.die_suffix)
            if self.die_after is not None and step >= self.die_after and dies:
                raise EngineDeadError("engine core process 4242 exited with code -9")
            if self.hold_after is not None and step >= self.hold_after:
                self.num_holding += 1
                await asyncio.get_running_loop().create_future()  # until cancelled
            await asyncio.sleep(0)  # let other requests interleave, as a real engine does
            last = step == len(ids) - 1
            text = self.tokenizer.decode(ids[: step + 1])
            delta = "" if step in self.held_back_steps and not last else text[shown:]
            shown += len(delta)
            finish = None
            if last:
                finish = "length" if len(ids) == params.max_tokens else "stop"
            yield RequestOutput(
                request_id=request.request_id,
                prompt=prompt,
                prompt_token_ids=request.prompt_token_ids,
                outputs=[
                    CompletionOutput(
                        index=0,
                        text=delta,
                        token_ids=[token_id],
                        finish_reason=finish,
                        logprobs=self._logprobs(token_id, params.logprobs),
                    )
                ],
                finished=last,
                num_cached_tokens=min(self.cached_tokens, len(request.prompt_token_ids) - 1),
                prompt_logprobs=self._prompt_logprobs(request) if step == 0 else None,
                pooled=self._pooled(request, self.pooled_size) if step == 0 else None,
            )

    @staticmethod
    def _pooled(request: EngineCoreRequest, size: int = EMBEDDING_SIZE) -> list[float] | None:
        """A pooling request's output (pooled_values); None for any other request."""
        if request.sampling_params.pooling is None:
            return None
        return pooled_values(request.prompt_token_ids, size)

    def _script_ids(self, request: EngineCoreRequest) -> list[int]:
        if self.texts is None:
            return self.script_ids
        choice = int(request.request_id.rsplit("-", 1)[1])
        return self.tokenizer.encode(self.texts[choice], add_special_tokens=False)

    def _logprobs(self, token_id: int, num: int | None) -> list[dict[int, Logprob]] | None:
        if num is None:
            return None
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(token_id, -0.5, 1, decode([token_id]))}
        for j in range(num):
            other = 100 + j if 100 + j != token_id else 200 + j
            entry[other] = Logprob(other, -2.0 - j, j + 2, decode([other]))
        return [entry]

    def _prompt_logprobs(
        self, request: EngineCoreRequest
    ) -> list[dict[int, Logprob] | None] | None:
        """Position i's prompt token at -1 - i / 10 (rank 2), under token 300 + i (rank 1)."""
        num = request.sampling_params.prompt_logprobs
        if num is None:
            return None
        decode = self.tokenizer.decode
        entries: list[dict[int, Logprob] | None] = [None]
        for i, token_id in enumerate(request.prompt_token_ids[1:], start=1):
            entry = {token_id: Logprob(token_id, -1.0 - i / 10, 2, decode([token_id]))}
            if num:
                entry[300 + i] = Logprob(300 + i, -0.5, 1, decode([300 + i]))
            entries.append(entry)
        return entries

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    async def wait_holding(self, count: int, timeout_s: float = 5.0) -> None:
        """Wait until `count` requests are parked at hold_after."""
        deadline = time.monotonic() + timeout_s
        while self.num_holding < count:
            assert time.monotonic() < deadline, f"only {self.num_holding} requests holding"
            await asyncio.sleep(0.001)


class SyncAPI:
    """Blocking calls into an ASGI app, each on its own event loop; bodies are read fully."""

    def __init__(self, app: Any, raise_app_exceptions: bool = True) -> None:
        self.app = app
        self.raise_app_exceptions = raise_app_exceptions

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async def run() -> httpx.Response:
            transport = httpx.ASGITransport(
                app=self.app, raise_app_exceptions=self.raise_app_exceptions
            )
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return await client.request(method, path, **kwargs)

        return asyncio.run(run())

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, json=body, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)


def parse_sse(response: httpx.Response) -> list[Any]:
    """The events of an SSE body: parsed JSON, or the string "[DONE]"; checks the framing."""
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events


async def body_writes(
    app: Any, path: str, body: Any, writes: list[bytes] | None = None
) -> list[bytes]:
    """POST to an ASGI app; the response body as the app sent it, one bytes per send.

    `writes`, if given, is filled as the app sends, for a test to follow the stream.
    """
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"api"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"x-request-id", b"writes"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("api", 80),
    }
    requests = [{"type": "http.request", "body": payload, "more_body": False}]
    writes = [] if writes is None else writes

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.get_running_loop().create_future()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message.get("body"):
            writes.append(message["body"])

    await app(scope, receive, send)
    return writes


def events_of(writes: list[bytes]) -> list[Any]:
    """The SSE events of a body sent in pieces (`created` set to 0, so two runs compare)."""
    text = b"".join(writes).decode()
    assert text.endswith("data: [DONE]\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        event = payload if payload == "[DONE]" else json.loads(payload)
        if isinstance(event, dict) and "created" in event:
            event["created"] = 0
        events.append(event)
    return events
