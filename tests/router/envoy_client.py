"""Envoy's part against an endpoint picker: its ext_proc filter, and what its data plane does.

`EnvoyClient.request` is one HTTP request through a gateway that fronts an InferencePool:
the request phase over ext_proc in the configured body mode (FULL_DUPLEX_STREAMED by
default, as the GIE's gateways run it; BUFFERED; STREAMED), the HTTP request to the
endpoints the picker names, in order, the next one when one refuses the connection (the
gateway's retries), and the response relayed through the ext_proc response phase with the
endpoint that served it in the metadata. When the picker cannot be reached or fails the
stream, the data plane does what the InferencePool's failure mode says: FailOpen sends the
request to any endpoint of the pool, FailClose answers 503.

`pick` and `finish` are the two phases on their own, for tests that script the upstream.
"""

from __future__ import annotations

import itertools
import json
import queue
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tidegate.engine.router.epp_messages import (
    BUFFERED,
    DESTINATION_HEADER,
    DESTINATION_NAMESPACE,
    FULL_DUPLEX_STREAMED,
    SERVED_KEY,
    STREAMED,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

Mode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED"]
MODES = {"FULL_DUPLEX_STREAMED": FULL_DUPLEX_STREAMED, "BUFFERED": BUFFERED, "STREAMED": STREAMED}
# Headers the data plane itself owns on the way upstream.
NOT_FORWARDED = frozenset({"content-length", "host", "transfer-encoding", "connection"})


class PickerFailed(Exception):
    """The picker could not be reached, or broke the stream off: the failure mode decides."""


@dataclass
class Decision:
    """What the picker answered for one request."""

    # The immediate response's status; None when the request was routed.
    status: int | None = None
    # The request headers as the data plane forwards them (the picker's mutation applied).
    headers: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    # The request body as the data plane forwards it.
    body: bytes = b""
    # envoy.lb dynamic metadata the picker set.
    metadata: dict[str, Any] = field(default_factory=dict)
    # The immediate response's headers and body.
    reply_headers: dict[str, str] = field(default_factory=dict)
    reply_body: bytes = b""
    # Whether the routing headers were set with clear_route_cache.
    cleared_route_cache: bool = False

    @property
    def endpoints(self) -> list[str]:
        """The header's endpoints, primary first."""
        value = self.headers.get(DESTINATION_HEADER, "")
        return [e for e in value.split(",") if e]

    @property
    def metadata_endpoints(self) -> list[str]:
        value = self.metadata.get(DESTINATION_NAMESPACE, {}).get(DESTINATION_HEADER, "")
        return [e for e in value.split(",") if e]

    def error(self) -> dict[str, Any]:
        """The immediate response's OpenAI error object."""
        return json.loads(self.reply_body)["error"]


@dataclass
class Relayed:
    """One request's outcome as the client sees it."""

    status: int
    headers: dict[str, str]
    body: bytes
    # The endpoint that answered; None when nothing upstream did (an immediate response).
    endpoint: str | None
    decision: Decision | None


class ExtProcStream:
    """One ext_proc stream (one HTTP request), driven message by message."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub, timeout_s: float) -> None:
        self._outbox: queue.Queue[ext_proc.ProcessingRequest | None] = queue.Queue()
        self._call = stub.Process(iter(self._outbox.get, None), timeout=timeout_s)

    def send(self, message: ext_proc.ProcessingRequest) -> None:
        self._outbox.put(message)

    def receive(self) -> ext_proc.ProcessingResponse:
        """The next answer; PickerFailed if the stream failed, StopIteration if it closed."""
        try:
            return next(self._call)
        except grpc.RpcError as error:
            raise PickerFailed(f"{error.code()}: {error.details()}") from None

    def close(self) -> grpc.StatusCode:
        """Half-close and wait for the picker to end the stream; its status."""
        self._outbox.put(None)
        for extra in self._call:
            raise AssertionError(f"an answer after the stream ended: {extra}")
        return self._call.code()

    def cancel(self) -> None:
        """As Envoy when its client goes away: reset the stream."""
        self._call.cancel()

    def code(self) -> grpc.StatusCode:
        return self._call.code()


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in headers.items()
        ]
    )


def metadata(namespace: str, values: dict[str, Any]) -> base_pb2.Metadata:
    entry = struct_pb2.Struct()
    entry.update(values)
    found = base_pb2.Metadata()
    found.filter_metadata[namespace].CopyFrom(entry)
    return found


def _chunks(body: bytes, size: int | None) -> list[bytes]:
    if not body:
        return []
    size = size or len(body)
    return [body[i : i + size] for i in range(0, len(body), size)]


class EnvoyClient:
    """Envoy's ext_proc filter and data plane, in one body mode, against one picker."""

    def __init__(
        self,
        target: str,
        mode: Mode = "FULL_DUPLEX_STREAMED",
        response_mode: Mode | None = None,
        send_body_without_waiting: bool = True,
        failure_mode: Literal["FailOpen", "FailClose"] = "FailClose",
        pool: Sequence[str] = (),
        timeout_s: float = 10.0,
    ) -> None:
        self.target = target
        self.mode = MODES[mode]
        self.response_mode = MODES[response_mode or mode]
        self.send_body_without_waiting = send_body_without_waiting
        self.failure_mode = failure_mode
        # The InferencePool's endpoints, which FailOpen chooses from.
        self.pool = list(pool)
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(target)
        self.stub = ext_proc_grpc.ExternalProcessorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> EnvoyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self, service: str) -> str:
        """The gRPC health status of a service, by name (SERVING, NOT_SERVING, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    def pick(
        self,
        path: str,
        body: bytes | dict[str, Any] | None,
        headers: dict[str, str] | None = None,
        subset: Sequence[str] | str | None = None,
        chunk_size: int | None = None,
        method: str = "POST",
    ) -> tuple[Decision, ExtProcStream]:
        """The request phase: the picker's decision, and the stream for the response phase."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
        request_headers = {
            ":method": method,
            ":path": path,
            ":authority": "gateway",
            **(headers or {}),
        }
        if raw:
            request_headers.setdefault("content-type", "application/json")
            request_headers["content-length"] = str(len(raw))
        stream = ExtProcStream(self.stub, self.timeout_s)
        first = ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(
                headers=header_map(request_headers), end_of_stream=not raw
            ),
            protocol_config=ext_proc.ProtocolConfiguration(
                request_body_mode=self.mode,
                response_body_mode=self.response_mode,
                send_body_without_waiting_for_header_response=self.send_body_without_waiting,
            ),
        )
        if subset is not None:
            first.metadata_context.CopyFrom(metadata(SUBSET_NAMESPACE, {SUBSET_KEY: subset}))
        decision = Decision(headers=dict(request_headers), body=raw)
        if self.mode == FULL_DUPLEX_STREAMED:
            # Envoy drops the length of a body the processor sends back: it may change.
            decision.headers.pop("content-length", None)
        stream.send(first)
        chunks = _chunks(raw, chunk_size)
        if not raw:
            self._apply(decision, stream.receive())
        elif self.mode == BUFFERED:
            if self._apply(decision, stream.receive()):
                stream.send(body_message(raw, end_of_stream=True))
                self._apply(decision, stream.receive())
        elif self.mode == STREAMED and not self.send_body_without_waiting:
            if self._apply(decision, stream.receive()):
                for index, chunk in enumerate(chunks):
                    stream.send(body_message(chunk, end_of_stream=index == len(chunks) - 1))
                    self._apply(decision, stream.receive())
        else:
            for index, chunk in enumerate(chunks):
                stream.send(body_message(chunk, end_of_stream=index == len(chunks) - 1))
            if self._apply(decision, stream.receive()):
                if self.mode == FULL_DUPLEX_STREAMED:
                    decision.body = self._receive_streamed(stream, "request_body")
                else:
                    for _ in chunks:
                        self._apply(decision, stream.receive())
        return decision, stream

    def finish(
        self,
        stream: ExtProcStream,
        status: int,
        headers: dict[str, str],
        chunks: Iterable[bytes],
        served: str | None,
    ) -> Iterator[bytes]:
        """The response phase: the body as relayed to the client, chunk by chunk.

        `served` is the endpoint the data plane reports as having served the request. As
        Envoy does for a response of unknown length, every chunk goes as it comes and an
        empty last one ends the body.
        """
        response_headers = {":status": str(status), **headers}
        source = iter(chunks)
        first = next(source, None)
        message = ext_proc.ProcessingRequest(
            response_headers=ext_proc.HttpHeaders(
                headers=header_map(response_headers), end_of_stream=first is None
            )
        )
        if served is not None:
            message.metadata_context.CopyFrom(metadata(DESTINATION_NAMESPACE, {SERVED_KEY: served}))
        stream.send(message)
        answer = stream.receive()
        assert answer.WhichOneof("response") == "response_headers", answer
        if first is None:
            stream.close()
            return
        if self.response_mode == BUFFERED:
            whole = first + b"".join(source)
            stream.send(body_message(whole, end_of_stream=True, request=False))
            assert stream.receive().WhichOneof("response") == "response_body"
            yield whole
        else:
            for chunk in itertools.chain([first], source, [b""]):
                stream.send(body_message(chunk, end_of_stream=not chunk, request=False))
                if self.response_mode == FULL_DUPLEX_STREAMED:
                    yield self._receive_streamed(stream, "response_body", expect=len(chunk))
                else:
                    assert stream.receive().WhichOneof("response") == "response_body"
                    yield chunk
        stream.close()

    def request(
        self,
        path: str,
        body: dict[str, Any] | bytes | None,
        headers: dict[str, str] | None = None,
        subset: Sequence[str] | None = None,
        chunk_size: int | None = None,
        method: str = "POST",
        served: str | None = None,
    ) -> Relayed:
        """One request through the gateway: pick, send upstream, relay the response.

        `served` overrides the endpoint reported as having served the request.
        """
        try:
            decision, stream = self.pick(path, body, headers, subset, chunk_size, method)
        except PickerFailed as error:
            return self._without_picker(path, body, headers, method, error)
        if decision.status is not None:
            stream.close()
            return Relayed(
                decision.status, decision.reply_headers, decision.reply_body, None, decision
            )
        forwarded = {
            k: v
            for k, v in decision.headers.items()
            if not k.startswith(":") and k not in NOT_FORWARDED
        }
        with httpx.Client(timeout=self.timeout_s) as http:
            for endpoint in decision.endpoints:
                try:
                    with http.stream(
                        method,
                        f"http://{endpoint}{path}",
                        content=decision.body or None,
                        headers=forwarded,
                    ) as response:
                        relayed = b"".join(
                            self.finish(
                                stream,
                                response.status_code,
                                dict(response.headers),
                                response.iter_raw(),
                                served or endpoint,
                            )
                        )
                        return Relayed(
                            response.status_code,
                            dict(response.headers),
                            relayed,
                            endpoint,
                            decision,
                        )
                except httpx.ConnectError:
                    continue  # the gateway's retry: the next endpoint of the list
        stream.cancel()
        return Relayed(503, {}, b"no healthy upstream", None, decision)

    def _without_picker(
        self,
        path: str,
        body: dict[str, Any] | bytes | None,
        headers: dict[str, str] | None,
        method: str,
        why: BaseException,
    ) -> Relayed:
        if self.failure_mode == "FailClose" or not self.pool:
            return Relayed(503, {}, f"endpoint picker unavailable: {why}".encode(), None, None)
        endpoint = random.choice(self.pool)
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        upstream = {"content-type": "application/json", **(headers or {})} if raw else headers
        with httpx.Client(timeout=self.timeout_s) as http:
            response = http.request(
                method, f"http://{endpoint}{path}", content=raw, headers=upstream
            )
        return Relayed(
            response.status_code, dict(response.headers), response.content, endpoint, None
        )

    def _apply(self, decision: Decision, answer: ext_proc.ProcessingResponse) -> bool:
        """Take one answer of the request phase; False once it is an immediate response."""
        kind = answer.WhichOneof("response")
        if kind == "immediate_response":
            reply = answer.immediate_response
            decision.status = reply.status.code
            decision.reply_headers = {
                o.header.key: o.header.raw_value.decode() for o in reply.headers.set_headers
            }
            decision.reply_body = reply.body
            return False
        assert kind in ("request_headers", "request_body"), answer
        common = getattr(answer, kind).response
        for option in common.header_mutation.set_headers:
            decision.headers[option.header.key] = option.header.raw_value.decode()
        for name in common.header_mutation.remove_headers:
            decision.headers.pop(name, None)
            decision.removed.append(name)
        if common.header_mutation.set_headers:
            decision.cleared_route_cache = common.clear_route_cache
        if answer.HasField("dynamic_metadata"):
            decision.metadata.update(json_format.MessageToDict(answer.dynamic_metadata))
        return True

    def _receive_streamed(
        self, stream: ExtProcStream, kind: str, expect: int | None = None
    ) -> bytes:
        """Streamed body answers until end_of_stream (or `expect` bytes came back)."""
        received = b""
        while True:
            answer = stream.receive()
            assert answer.WhichOneof("response") == kind, answer
            streamed = getattr(answer, kind).response.body_mutation.streamed_response
            received += streamed.body
            if streamed.end_of_stream or (expect is not None and len(received) >= expect):
                return received


def body_message(
    chunk: bytes, end_of_stream: bool, request: bool = True
) -> ext_proc.ProcessingRequest:
    """A request (or response) body message."""
    body = ext_proc.HttpBody(body=chunk, end_of_stream=end_of_stream)
    if request:
        return ext_proc.ProcessingRequest(request_body=body)
    return ext_proc.ProcessingRequest(response_body=body)
