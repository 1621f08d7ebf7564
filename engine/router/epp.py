"""The Gateway API Inference Extension's endpoint picker, served by `tidegate router --epp-port`.

A gateway that fronts an InferencePool (Envoy, or one built on it) streams every request to
the endpoint picker over Envoy's ext_proc gRPC service and routes it to the model servers we
name, in the request header `x-gateway-destination-endpoint` and the same value in dynamic
metadata (`envoy.lb`): up to ENDPOINTS_PER_PICK of them, best first, the rest fallbacks for
the gateway's retries. The choice is the router's own (InstancePool.rank: blocks held,
adapters, rendezvous order within load), from the same pools and health checks as its HTTP
traffic; the picker sends nothing itself. The InferencePool is the decode pool (in balancer
mode, the unified instances); in P/D mode a request that takes a prefill leg also gets
`x-prefiller-host-port` naming the best prefill instance, which a decode engine started with
--prefill-via-header asks for the prompt's KV. With no healthy prefill instance the request
goes to decode without it, and the decode instance computes its prompt itself.

The order of messages depends on Envoy's body modes, which Envoy states in the first
message's protocol_config (without one: FULL_DUPLEX_STREAMED, the mode the GIE's own picker
is written for):

- FULL_DUPLEX_STREAMED, and STREAMED with send_body_without_waiting_for_header_response: the
  answer to the headers waits for the whole body (end_of_stream, or the trailers). Then come
  the headers' answer, carrying the routing, and the body's: in FULL_DUPLEX_STREAMED the body
  itself, sent back in chunks (Envoy forwards only what the processor sends), in STREAMED one
  empty answer per chunk received.
- BUFFERED and BUFFERED_PARTIAL: the headers are answered at once, unchanged, and the routing
  goes with the body's answer, the one mode in which Envoy applies headers set there. A
  BUFFERED_PARTIAL body cut at Envoy's buffer limit is routed without it.
- No body (headers with end_of_stream, or body mode NONE), or STREAMED waiting for the headers'
  answer: routed at the headers, by the request id, with no prompt to go by.

Responses: headers answered unchanged (their metadata says which endpoint served), body chunks
echoed in FULL_DUPLEX_STREAMED and answered empty otherwise, trailers answered empty. An
immediate response ends the stream: 400 for a body that is not a JSON object, 503 with no
healthy endpoint (or none in the gateway's subset hint), 429 when shedding (--epp-shed-load)
or when the request's tenant has its limit in flight (the router's per-tenant limit,
router/tenant_limits.py, counted from the pick to the end of the response), 401 when the
router has API keys and the request names none of them.
A body over MAX_BODY_BYTES is a 413 (the picker buffers it whole).
A message the protocol does not allow closes the stream with INVALID_ARGUMENT, and the
gateway's failure mode (FailOpen, FailClose) decides.

Load: a pick counts one request in flight on its first endpoint, moved to the one the gateway
reports as having served it (a fallback), and given back once, when the response ends or the
stream closes. A prefill instance's count is given back when the decode instance's response
starts: its leg is over by then.

A 5xx the gateway relays does not take its instance out of rotation: Envoy's own local replies
(connect failures, timeouts, overflow) carry the same statuses, and the next health check
(router/health.py) sees a dead instance anyway. The exception is a draining engine's 503
(DRAINING_HEADER), which says for certain that the instance takes nothing more.

gRPC health: `liveness` is SERVING while the process runs; `readiness`, the ext_proc service
and the server as a whole ("") are SERVING while the decode pool has a healthy instance,
refreshed after every health round. In P/D mode a missing prefill pool does not make the
picker unready: it still routes, to decode alone.

On shutdown every stream is closed cleanly: Envoy relays the responses already routed without
the picker, and treats new requests as it treats a picker that is down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.auth import APIKeys, key_refusal, tenant_cache_salt
from tidegate.engine.entrypoints.openai.errors import OpenAIError
from tidegate.engine.entrypoints.openai.tenants import request_tenant
from tidegate.engine.http_server import DRAINING_HEADER
from tidegate.engine.router import errors
from tidegate.engine.router.epp_messages import (
    BUFFERED,
    BUFFERED_PARTIAL,
    DESTINATION_HEADER,
    FULL_DUPLEX_STREAMED,
    NONE,
    PREFILL_HEADER,
    STREAMED,
    BodyMode,
    body_response,
    destination_metadata,
    header_map,
    header_mutation,
    headers_response,
    immediate_response,
    served_endpoint,
    streamed_body,
    subset_hint,
    trailers_response,
)
from tidegate.engine.router.instances import Instance, InstancePool
from tidegate.engine.router.metrics import RouterMetrics
from tidegate.engine.router.proxy import Proxy
from tidegate.engine.router.routing import Route
from tidegate.engine.router.tenant_limits import Tenant, TenantCounts

logger = logging.getLogger("tidegate.router")

# The primary and two fallbacks: enough for the gateway to retry past a dying instance
# without sending the request to one the ranking puts far behind.
ENDPOINTS_PER_PICK = 3
# The most request body the picker buffers to route by; past it the request is refused (413)
# rather than held in memory. A 128k-token prompt is well under 1 MiB of text.
MAX_BODY_BYTES = 32 * 1024 * 1024
# The InferencePool the gateway asks about (in balancer mode it holds the unified instances).
POOL = "decode"
LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Streams are told to end before the server stops; this bounds how long they take to.
STOP_GRACE_S = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# headers_response or body_response: which message carries the routing.
Answer = Callable[
    [bool, ext_proc.HeaderMutation | None, struct_pb2.Struct | None], ext_proc.ProcessingResponse
]


class ProtocolViolation(Exception):
    """A message the ext_proc protocol does not allow at this point of the stream."""


def endpoint_of(url: str) -> str:
    """`host:port` of an instance URL, as data planes name endpoints."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _in_subset(url: str, subset: Collection[str]) -> bool:
    """Whether the subset names this instance: by `host:port`, or by its address (any port)."""
    host = urlsplit(url).hostname or ""
    return endpoint_of(url) in subset or host in subset or f"[{host}]" in subset


class Lease:
    """One request counted in flight on an instance, given back exactly once."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.held = True
        instance.in_flight += 1

    def move(self, instance: Instance) -> None:
        """Count the request on `instance` instead (a fallback served it)."""
        if self.held and instance is not self.instance:
            self.instance.in_flight -= 1
            instance.in_flight += 1
            self.instance = instance

    def release(self) -> None:
        if self.held:
            self.held = False
            self.instance.in_flight -= 1


class Refused(Exception):
    """A request the picker refuses, and the outcome it counts as."""

    def __init__(self, error: OpenAIError, outcome: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


class TenantLease:
    """One request counted in flight for its tenant, given back exactly once."""

    def __init__(self, counts: TenantCounts, tenant: Tenant) -> None:
        self.counts = counts
        self.tenant = tenant
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.counts.release(self.tenant)


@dataclass
class Pick:
    """Where one request goes: its endpoints best first, its prefill instance if any, and
    its count against its tenant's limit if there is one."""

    endpoints: list[Instance]
    prefill: Instance | None = None
    tenant: TenantLease | None = None


class Picker:
    """Chooses the endpoints of one request from the router's pools."""

    def __init__(self, args: RouterArgs, proxy: Proxy, keys: APIKeys | None = None) -> None:
        self.proxy = proxy
        # Envoy hands us header names in lower case.
        self.cache_salt_header = args.cache_salt_header.lower() if args.cache_salt_header else None
        self.shed_load = args.epp_shed_load
        # With API keys a request's key is checked here too: a key that names a tenant must
        # be a real one, or made-up keys would each get a tenant's limit.
        self.keys = keys
        per_tenant = args.max_in_flight_per_tenant
        self.tenants = (
            None
            if per_tenant is None
            else TenantCounts(per_tenant, lambda: len(self.pool.healthy()))
        )
        self.metrics: RouterMetrics = proxy.metrics
        self._prefill_missing = False
        self._warned: set[str] = set()

    @property
    def pool(self) -> InstancePool:
        return self.proxy.pools[POOL]

    async def pick(
        self,
        path: str,
        body: dict[str, Any] | None,
        request_id: str,
        headers: Mapping[str, str],
        subset: list[str] | None,
    ) -> Pick:
        """The endpoints for this request (None: no body to go by); an OpenAIError if none,
        if its API key is not valid, or if its tenant is at its limit (the pick then counts one
        request of its tenant, in `Pick.tenant`, which the exchange gives back)."""
        if self.keys is not None:
            authorization = headers.get("authorization")
            refusal = key_refusal(
                None if authorization is None else authorization.encode("latin-1"), self.keys
            )
            if refusal is not None:
                raise Refused(refusal, "unauthorized")
        retry_after_s = self.proxy.retry_after_s
        body = dict(body or {})
        if self.cache_salt_header is not None:
            # As for HTTP requests (router/app.py): the engines derive the same salt from the
            # same header, so the blocks the route looks for are the ones they will hold.
            body["cache_salt"] = tenant_cache_salt(headers, self.cache_salt_header)
        route = await self.proxy.route(path, body, request_id)
        only = None
        if subset is not None:
            only = {i.url for i in self.pool if _in_subset(i.url, subset)}
            if not only:
                raise errors.no_instance_in_subset(self.pool, subset, retry_after_s)
        ranked = self.pool.rank(route, only=only)
        if not ranked:
            if subset is not None:
                raise errors.no_instance_in_subset(self.pool, subset, retry_after_s)
            raise errors.no_instance(self.pool, retry_after_s)
        least = min(i.load for i in ranked)
        if self.shed_load is not None and least >= self.shed_load:
            raise errors.shed(least, self.shed_load, retry_after_s)
        pick = Pick(ranked[:ENDPOINTS_PER_PICK])
        if body and self.proxy.needs_prefill(path, body):
            pick.prefill = self._prefill(route)
        if self.tenants is not None:
            tenant = request_tenant(headers, self.cache_salt_header, self.keys is not None)
            refusal = self.tenants.admit(tenant)
            if refusal is not None:
                raise Refused(refusal, "tenant_limit")
            pick.tenant = TenantLease(self.tenants, tenant)
        return pick

    def _prefill(self, route: Route) -> Instance | None:
        best = self.proxy.pools["prefill"].rank(route, limit=1)
        if best:
            self._prefill_missing = False
            return best[0]
        if not self._prefill_missing:
            # Once per outage, not per request.
            logger.warning(
                "no healthy prefill instance: the endpoint picker sends requests to decode "
                "instances alone, which compute their prompts themselves"
            )
            self._prefill_missing = True
        return None

    def instance_at(self, endpoint: str) -> Instance | None:
        """The pool's instance at this `host:port`, healthy or not."""
        return next((i for i in self.pool if endpoint_of(i.url) == endpoint), None)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise errors.not_json(str(error)) from None
    if not isinstance(body, dict):
        raise errors.not_json(f"got a JSON {type(body).__name__}")
    return body


def _outcome(error: OpenAIError) -> str:
    if error.status == 429:
        return "shed"
    if error.status == 503:
        return "no_endpoint"
    return "error"


class Exchange:
    """One HTTP request's ext_proc stream: what came so far, and the load it holds.

    `handle` takes each message and returns the answers to send, in order.
    """

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.request_mode: BodyMode = FULL_DUPLEX_STREAMED
        self.response_mode: BodyMode = FULL_DUPLEX_STREAMED
        self.body_without_waiting = True
        self.headers: dict[str, str] | None = None
        self.request_id = ""
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.chunks = 0
        self.waiting_for_body = False
        self.routed = False
        # Set once an outcome is counted; "picked" or an immediate response's.
        self.outcome: str | None = None
        # An immediate response was sent: Envoy ignores anything after it.
        self.finished = False
        self.lease: Lease | None = None
        self.prefill_lease: Lease | None = None
        self.tenant_lease: TenantLease | None = None
        self.served_known = False

    @property
    def path(self) -> str:
        assert self.headers is not None
        return (self.headers.get(":path") or "/").split("?", 1)[0]

    async def handle(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_mode = config.request_body_mode
            self.response_mode = config.response_body_mode
            self.body_without_waiting = (
                config.send_body_without_waiting_for_header_response
                or self.request_mode == FULL_DUPLEX_STREAMED
            )
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message)
        if kind == "response_trailers":
            self.release()
            return [trailers_response(request_phase=False)]
        raise ProtocolViolation("a ProcessingRequest with no request or response part")

    def release(self) -> None:
        """Give back what this request counts in flight (idempotent)."""
        for lease in (self.lease, self.prefill_lease, self.tenant_lease):
            if lease is not None:
                lease.release()

    @property
    def _echoes_request(self) -> bool:
        # FULL_DUPLEX_STREAMED, and any mode newer than this code: answer in streamed chunks.
        return self.request_mode not in (NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL)

    @property
    def _echoes_response(self) -> bool:
        return self.response_mode not in (NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL)

    async def _request_headers(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        if self.headers is not None:
            raise ProtocolViolation("request headers came twice")
        self.headers = header_map(message.request_headers.headers)
        self.request_id = self.headers.get("x-request-id") or uuid.uuid4().hex
        self._read_subset(message)
        if message.request_headers.end_of_stream or self.request_mode == NONE:
            return [await self._routing_answer(None, headers_response)]
        if self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            return [headers_response(request_phase=True)]
        if not self.body_without_waiting:
            self.picker.warn_once(
                "streamed",
                "the gateway streams request bodies only after the headers are answered "
                "(STREAMED without send_body_without_waiting_for_header_response): requests are "
                "routed without their prompt; use FULL_DUPLEX_STREAMED or BUFFERED",
            )
            return [await self._routing_answer(None, headers_response)]
        self.waiting_for_body = True
        return []

    async def _request_body(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        if self.headers is None:
            raise ProtocolViolation("a request body before the request headers")
        self._read_subset(message)
        chunk = message.request_body
        if self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            if self.routed:
                raise ProtocolViolation("a second request body in a buffered mode")
            whole = self.request_mode == BUFFERED or chunk.end_of_stream
            return [await self._routing_answer(chunk.body if whole else None, body_response)]
        if not self.waiting_for_body:
            if self.routed and self.request_mode == STREAMED:
                return [body_response(request_phase=True)]  # routed at the headers
            raise ProtocolViolation("a request body after the request was routed")
        self.body += chunk.body
        self.chunks += 1
        if len(self.body) > MAX_BODY_BYTES:
            self.waiting_for_body = False
            self.body = bytearray()
            return [self._refuse(errors.body_too_large(MAX_BODY_BYTES))]
        return await self._answer_body(end_of_stream=True) if chunk.end_of_stream else []

    async def _request_trailers(self) -> list[ext_proc.ProcessingResponse]:
        if self.headers is None:
            raise ProtocolViolation("request trailers before the request headers")
        # Trailers end a body that had no end_of_stream of its own.
        answers = await self._answer_body(end_of_stream=False) if self.waiting_for_body else []
        if self.finished:
            return answers
        return [*answers, trailers_response(request_phase=True)]

    async def _answer_body(self, end_of_stream: bool) -> list[ext_proc.ProcessingResponse]:
        """The whole body is here: the deferred headers' answer, then the body's."""
        self.waiting_for_body = False
        body = bytes(self.body)
        self.body = bytearray()
        routing = await self._routing_answer(body, headers_response)
        if self.finished:
            return [routing]
        if self._echoes_request:
            return [routing, *streamed_body(True, body, end_of_stream)]
        return [routing, *(body_response(request_phase=True) for _ in range(self.chunks))]

    def _refuse(
        self, error: OpenAIError, outcome: str | None = None
    ) -> ext_proc.ProcessingResponse:
        """The immediate response that ends the stream with this error."""
        self.finished = True
        self.count(outcome or _outcome(error))
        logger.debug("endpoint picker refuses %s: %s", self.path, error.message)
        return immediate_response(error, f"tidegate_epp_{self.outcome}")

    async def _routing_answer(self, raw: bytes | None, kind: Answer) -> ext_proc.ProcessingResponse:
        """The answer (headers or body, `kind`) that routes the request; or its refusal.

        `raw` is the whole request body; None routes without one.
        """
        assert self.headers is not None
        try:
            body = _parse(raw) if raw is not None else None
            pick = await self.picker.pick(
                self.path, body, self.request_id, self.headers, self.subset
            )
        except OpenAIError as error:
            return self._refuse(error)
        except Refused as refused:
            return self._refuse(refused.error, refused.outcome)
        self.routed = True
        self.count("picked")
        self.lease = Lease(pick.endpoints[0])
        self.tenant_lease = pick.tenant
        endpoints = ",".join(endpoint_of(i.url) for i in pick.endpoints)
        set_headers = {DESTINATION_HEADER: endpoints}
        remove = []
        if pick.prefill is not None:
            self.prefill_lease = Lease(pick.prefill)
            set_headers[PREFILL_HEADER] = endpoint_of(pick.prefill.url)
        elif PREFILL_HEADER in self.headers:
            # Only the picker names a prefill instance: a client's would make the decode
            # engine fetch KV from wherever the client says.
            remove.append(PREFILL_HEADER)
        if "x-request-id" not in self.headers:
            set_headers["x-request-id"] = self.request_id  # the same id on both P/D legs
        if raw is not None and self._echoes_request:
            # Envoy drops the length of a body it streams; the body we send back is unchanged.
            set_headers["content-length"] = str(len(raw))
        return kind(True, header_mutation(set_headers, remove), destination_metadata(endpoints))

    def _response_headers(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        headers = header_map(message.response_headers.headers)
        self._note_served(message)
        if self.prefill_lease is not None:
            self.prefill_lease.release()
        draining = headers.get(":status") == "503" and DRAINING_HEADER in headers
        if draining and self.lease is not None and self.lease.held:
            self.picker.pool.mark_down(self.lease.instance, "answered 503: draining (via gateway)")
        if message.response_headers.end_of_stream:
            self.release()
        return [headers_response(request_phase=False)]

    def _response_body(
        self, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        self._note_served(message)
        chunk = message.response_body
        if chunk.end_of_stream:
            self.release()
        if self._echoes_response:
            return streamed_body(False, chunk.body, chunk.end_of_stream)
        return [body_response(request_phase=False)]

    def _read_subset(self, message: ext_proc.ProcessingRequest) -> None:
        subset = subset_hint(message)
        if subset is not None:
            self.subset = subset

    def _note_served(self, message: ext_proc.ProcessingRequest) -> None:
        if self.lease is None or self.served_known:
            return
        served = served_endpoint(message)
        if served is None:
            return
        self.served_known = True
        if served == endpoint_of(self.lease.instance.url):
            return
        instance = self.picker.instance_at(served)
        if instance is None:
            # The gateway only tries endpoints we named, so this is most likely one of them
            # under another name (an address for a host name): the count stays where it is.
            logger.debug("the gateway reports %s, not an endpoint of the pool, served", served)
        else:
            self.lease.move(instance)

    def count(self, outcome: str) -> None:
        """Count this request's outcome, once (a later failure does not count it again)."""
        if self.outcome is None:
            self.outcome = outcome
            self.picker.metrics.epp_picks.labels(outcome).inc()


class _ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    """Envoy's ext_proc service: one stream per HTTP request."""

    def __init__(self, picker: Picker, stopping: asyncio.Event) -> None:
        self.picker = picker
        self.stopping = stopping

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        exchange = Exchange(self.picker)
        stop = asyncio.ensure_future(self.stopping.wait())
        read: asyncio.Future[Any] | None = None
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            while not exchange.finished:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    return  # the router stops: a clean close, Envoy goes on without us
                message = read.result()
                if message is grpc.aio.EOF:
                    return
                try:
                    answers = await exchange.handle(message)
                except ProtocolViolation as error:
                    logger.warning("endpoint picker closes an ext_proc stream: %s", error)
                    failure = (grpc.StatusCode.INVALID_ARGUMENT, str(error))
                    break
                except Exception:
                    # One stream's failure must not stop the server or leak its in-flight count.
                    logger.exception("endpoint picker failed on an ext_proc message")
                    failure = (grpc.StatusCode.INTERNAL, "the endpoint picker failed")
                    break
                for answer in answers:
                    await context.write(answer)
        finally:
            stop.cancel()
            if read is not None:
                read.cancel()
            exchange.release()
        if failure is not None:
            exchange.count("error")
            await context.abort(*failure)


def _listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EndpointPicker:
    """The gRPC server of ext_proc and health, on the router's event loop."""

    def __init__(self, args: RouterArgs, proxy: Proxy, keys: APIKeys | None = None) -> None:
        assert args.epp_port is not None
        self.proxy = proxy
        self.picker = Picker(args, proxy, keys)
        self.health = health.aio.HealthServicer()
        self._stopping = asyncio.Event()
        # Without SO_REUSEPORT a port another process holds is an error, not a shared port.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            _ExternalProcessor(self.picker, self._stopping), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = _listen_address(args.host, args.epp_port)
        try:
            self.port: int = self.server.add_insecure_port(address)
        except RuntimeError as error:
            raise RuntimeError(f"the endpoint picker cannot listen on {address}: {error}") from None

    async def start(self) -> None:
        await self.refresh_health()
        await self.server.start()
        logger.info("endpoint picker (ext_proc and gRPC health) on port %d", self.port)

    async def refresh_health(self) -> None:
        """Readiness follows the decode pool: SERVING while it has a healthy instance."""
        ready = SERVING if self.proxy.pools[POOL].healthy() else NOT_SERVING
        await self.health.set(LIVENESS, SERVING)
        for service in ("", READINESS, EXT_PROC_SERVICE):
            await self.health.set(service, ready)

    async def stop(self) -> None:
        """NOT_SERVING, every stream closed cleanly, then the port closed."""
        await self.health.enter_graceful_shutdown()
        self._stopping.set()
        await self.server.stop(STOP_GRACE_S)


async def serve_endpoint_picker(
    args: RouterArgs, proxy: Proxy, keys: APIKeys | None = None
) -> EndpointPicker:
    """Start the endpoint picker on --epp-port (0: a free port, read from `.port`)."""
    picker = EndpointPicker(args, proxy, keys)
    await picker.start()
    return picker
