"""What the HTTP layer needs of the engine (AsyncLLM implements it; tests use a fake)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tidegate.engine.input_processor import InputProcessor
    from tidegate.engine.messages import EngineCoreRequest
    from tidegate.engine.outputs import RequestOutput
    from tidegate.engine.tokenizer import Tokenizer


class EngineClient(Protocol):
    """A running engine: tokenizer, input checks, and streaming generation."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def input_processor(self) -> InputProcessor: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_role(self) -> str:
        """none, producer or consumer (disaggregated prefill/decode)."""
        ...

    @property
    def is_dead(self) -> bool:
        """True once an engine process died; the server is going down."""
        ...

    @property
    def dead_reason(self) -> str | None: ...

    def generate(
        self, request: EngineCoreRequest, prompt: str | None = None
    ) -> AsyncIterator[list[RequestOutput]]:
        """Submit a validated request; yield its delta outputs until it finishes.

        Each item holds every delta that arrived since the previous one, in order (one per
        engine step, several when the reader fell behind), so that a stream writes them at once.

        The first `__anext__` raises EngineOverloadedError when the waiting queue is full; any
        may raise EngineDeadError. Closing or cancelling the iterator early aborts the request.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks."""
        ...


class MetricsRenderer(Protocol):
    """Prometheus metrics of the server and its engine."""

    def render(self) -> tuple[bytes | str, str]:
        """The exposition body and its content type."""
        ...
