"""Fake prefill and decode engines that speak the router's protocol, on real sockets."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tidegate.common.local_server import free_port
from tidegate.engine.entrypoints.openai.pd_bodies import POOLING_PATHS
from tidegate.engine.http_server import DRAINING_HEADER

DEADLINE_S = 10.0
BASE_MODEL = "tiny"


def sse(data: Any) -> bytes:
    """One SSE event."""
    return f"data: {json.dumps(data)}\n\n".encode()


# What a streaming decode sends, byte for byte.
DECODE_CHUNKS = [sse({"choices": [{"index": 0, "text": word}]}) for word in ("one", "two", "3")]
DECODE_CHUNKS.append(b"data: [DONE]\n\n")


@dataclass
class Received:
    """One request a fake engine got."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeEngine:
    """A prefill or decode engine whose answers a test scripts and whose requests it reads."""

    role: str
    name: str = "engine"
    received: list[Received] = field(default_factory=list)
    error_status: int | None = None  # answer every completion with this status
    draining: bool = False  # as a server told to stop: /health and completions 503
    healthy: bool = True
    reported_load: float = 0.0  # what /metrics says is running
    gate: threading.Event | None = None  # a stream waits here after its first chunk
    hold: bool = False  # a stream stops after its first chunk until the client leaves
    die_after: int | None = None  # a stream breaks off after this many chunks
    disconnected: threading.Event = field(default_factory=threading.Event)
    # LoRA adapters loaded and ready; None: no LoRA, and no LoRA metrics at all.
    adapters: list[str] | None = None
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    # Its rollout track and weight, as tidegate:revision_info; None: no such metric at all.
    track: str | None = None
    traffic_weight: str = ""

    def app(self) -> Starlette:
        """The engine as an ASGI app."""
        return Starlette(
            routes=[
                Route("/v1/completions", self._completion, methods=["POST"]),
                Route("/v1/chat/completions", self._completion, methods=["POST"]),
                *(Route(path, self._completion, methods=["POST"]) for path in POOLING_PATHS),
                Route("/v1/models", self._models),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
            ]
        )

    def kv_params(self, request_id: str) -> dict[str, Any]:
        """The kv_transfer_params this prefill engine answers a request id with."""
        return {"remote_engine": self.name, "remote_block_ids": [1, 2], "request_id": request_id}

    async def _completion(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(Received(request.url.path, body, dict(request.headers)))
        if self.draining:
            error = {"message": f"{self.name} is shutting down", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=503, headers={DRAINING_HEADER: "1"})
        if self.error_status is not None:
            error = {"message": f"{self.name} refuses", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=self.error_status)
        if self.adapters is not None and body.get("model") not in (BASE_MODEL, *self.adapters):
            # As an engine answers a model or adapter it does not serve.
            message = f"{self.name} has no model {body.get('model')}"
            error = {"message": message, "type": "invalid_request_error", "code": "not_found"}
            return JSONResponse({"error": error}, status_code=404)
        request_id = request.headers.get("x-request-id", "")
        if self.role == "prefill":
            choice = {"index": 0, "text": "x", "finish_reason": "length"}
            params = self.kv_params(request_id)
            return JSONResponse(
                {"id": request_id, "choices": [choice], "kv_transfer_params": params}
            )
        if body.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        answer = {"id": request_id, "engine": self.name, "choices": [{"text": "one two 3"}]}
        return JSONResponse(answer)

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            for index, chunk in enumerate(DECODE_CHUNKS):
                if index == self.die_after:
                    raise RuntimeError("the fake decode engine dies mid-stream")
                yield chunk
                if index == 0 and self.gate is not None:
                    await _wait_event(self.gate)
                if index == 0 and self.hold:
                    await asyncio.Event().wait()  # until the client goes away
        finally:
            self.disconnected.set()

    async def _models(self, request: Request) -> Response:
        self.received.append(Received(request.url.path, {}, dict(request.headers)))
        return JSONResponse({"object": "list", "data": [{"id": BASE_MODEL, "object": "model"}]})

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy and not self.draining else 503)

    async def _metrics(self, request: Request) -> Response:
        text = (
            "# TYPE tidegate:num_requests_running gauge\n"
            f'tidegate:num_requests_running{{engine="0"}} {self.reported_load}\n'
            'tidegate:num_requests_waiting{engine="0"} 0.0\n'
        )
        if self.track is not None:
            text += (
                f'tidegate:revision_info{{model_name="{BASE_MODEL}",track="{self.track}",'
                f'traffic_weight="{self.traffic_weight}"}} 1.0\n'
            )
        if self.adapters is not None:
            text += "# TYPE tidegate:lora_adapter_ready gauge\n" + "".join(
                f'tidegate:lora_adapter_ready{{adapter="{name}"}} 1.0\n' for name in self.adapters
            )
            running, waiting = ",".join(self.running_adapters), ",".join(self.waiting_adapters)
            # An older state first, as vLLM leaves it exported: only the newest one counts.
            text += (
                'vllm:lora_requests_info{max_lora="4",running_lora_adapters="stale",'
                'waiting_lora_adapters=""} 1.0e9\n'
                f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="{waiting}"}} {time.time()}\n'
            )
        return Response(text, media_type="text/plain")


async def _wait_event(event: threading.Event) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not event.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


class ServerThread:
    """An ASGI app served by uvicorn on a loopback address from a background thread."""

    def __init__(
        self, app: Any, port: int | None = None, lifespan: str = "off", host: str = "127.0.0.1"
    ) -> None:
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan=lifespan,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        """Serve, returning once the port accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, force: bool = True) -> None:
        """Stop serving; forced, drop every connection at once (to a client, a dead server)."""
        self.request_stop(force)
        self.join()

    def request_stop(self, force: bool = True) -> None:
        """Ask the server to stop, without waiting (so that several stop at once)."""
        self.server.should_exit = True
        self.server.force_exit = force

    def join(self) -> None:
        """Wait until the server has stopped."""
        self._thread.join(DEADLINE_S)
