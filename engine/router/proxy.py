"""One client request through the two legs: prefill on one instance, decode on another."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx
from starlette.responses import Response

from tidegate.engine.config import RouterArgs
from tidegate.engine.entrypoints.openai.pd_bodies import (
    client_body,
    decode_body,
    needs_prefill,
    prefill_body,
)
from tidegate.engine.http_server import DRAINING_HEADER
from tidegate.engine.router import errors
from tidegate.engine.router.block_index import BlockIndex
from tidegate.engine.router.instances import Instance, InstancePool
from tidegate.engine.router.metrics import RouterMetrics
from tidegate.engine.router.pending import Holding
from tidegate.engine.router.relay import Outcome, RelayResponse, relayed_headers
from tidegate.engine.router.routing import PromptTokenizer, Route, request_route

logger = logging.getLogger("tidegate.router")


class Proxy:
    """Sends each leg to a chosen instance, failing over to another when one is down."""

    def __init__(self, args: RouterArgs, client: httpx.AsyncClient) -> None:
        # Routing by held blocks: the engines' KV events, and prompts tokenized as they do.
        self.tokenizer = PromptTokenizer(args.tokenizer) if args.tokenizer else None
        self.index = BlockIndex(args.kv_events_port) if self.tokenizer is not None else None
        self.pools = {
            "prefill": InstancePool("prefill", index=self.index),
            "decode": InstancePool("decode", index=self.index),
        }
        # Without prefill instances the router balances whole requests over the decode pool.
        self.disaggregated = bool(args.prefill)
        self.client = client
        self.retry_after_s = args.health_interval
        self.holding = Holding(args.max_pending, args.pending_timeout, self.retry_after_s)
        self.metrics = RouterMetrics(list(self.pools.values()), self.held_pools())
        self.prefill_timeout = httpx.Timeout(args.prefill_timeout, connect=args.connect_timeout)
        # No read timeout on the decode leg: a generation may take as long as it takes.
        self.decode_timeout = httpx.Timeout(None, connect=args.connect_timeout)
        self.models_timeout = httpx.Timeout(30.0, connect=args.connect_timeout)

    def held_pools(self) -> dict[str, InstancePool]:
        """The pools requests wait for, by the deployment's pool name (balancer: "unified")."""
        if self.disaggregated:
            return {"prefill": self.pools["prefill"], "decode": self.pools["decode"]}
        return {"unified": self.pools["decode"]}

    async def route(self, path: str, body: Mapping[str, Any], request_id: str) -> Route:
        """What picking an instance for this body needs (router/routing.py).

        With a tokenizer, on a worker thread: a long chat takes tens of milliseconds to
        render and tokenize (about 0.1 s for 65,000 tokens), which on the event loop would
        hold up every stream the router relays.
        """
        if self.tokenizer is None:
            return request_route(path, body, request_id)
        return await asyncio.to_thread(request_route, path, body, request_id, self.tokenizer)

    def needs_prefill(self, path: str, body: Mapping[str, Any]) -> bool:
        """Whether this request takes a prefill leg first (disaggregated, and its shape fits)."""
        return self.disaggregated and needs_prefill(path, body)

    async def completion(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> Response:
        """Serve a (chat) completion: prefill leg when it applies, then the decode leg."""
        # Both legs prefer instances that hold the prompt's blocks, and those that serve the
        # adapter the model field may name.
        route = await self.route(path, body, headers["x-request-id"])
        deadline = self.holding.deadline()
        if not self.needs_prefill(path, body):
            if self.disaggregated:
                self.metrics.prefill_skipped.inc()
            return await self._decode(path, client_body(body), headers, route, deadline)
        # A decode instance first: the prefill's KV blocks would wait for a decode that never
        # comes (they expire). No healthy one: wait for one, or fail before the prefill leg.
        await self.holding.until_ready(self.pools["decode"], deadline)
        started = time.monotonic()
        instance, response = await self._send(
            "prefill",
            "POST",
            path,
            prefill_body(path, body),
            headers,
            route,
            self.prefill_timeout,
            deadline,
        )
        self.metrics.latency.labels("prefill").observe(time.monotonic() - started)
        if response.status_code >= 300:
            # 4xx: the client's request is wrong (bad model, bad params, prompt too long);
            # the decode instance would say the same.
            return _copy(response)
        try:
            params = response.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise errors.bad_gateway(
                f"prefill instance {instance.url} answered {path} with no JSON object"
            ) from None
        if params is None:
            logger.warning("prefill instance %s returned no kv_transfer_params", instance.url)
        return await self._decode(path, decode_body(body, params), headers, route, deadline)

    async def models(self, headers: Mapping[str, str]) -> Response:
        """GET /v1/models from a decode instance: the names clients may use."""
        _, response = await self._send(
            "decode",
            "GET",
            "/v1/models",
            None,
            headers,
            Route(headers["x-request-id"]),
            self.models_timeout,
            self.holding.deadline(),
            leg="models",
        )
        return _copy(response)

    async def _decode(
        self,
        path: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        route: Route,
        deadline: float,
    ) -> Response:
        started = time.monotonic()
        instance, response = await self._send(
            "decode",
            "POST",
            path,
            body,
            headers,
            route,
            self.decode_timeout,
            deadline,
            stream=True,
        )
        pool = self.pools["decode"]

        async def on_close(outcome: Outcome) -> None:
            instance.in_flight -= 1
            self.metrics.latency.labels("decode").observe(time.monotonic() - started)
            if outcome == "broken":
                pool.mark_down(instance, "broke off a response part-way")

        return RelayResponse(response, on_close)

    async def _send(
        self,
        role: str,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: Mapping[str, str],
        route: Route,
        timeout: httpx.Timeout,
        deadline: float,
        stream: bool = False,
        leg: str | None = None,
    ) -> tuple[Instance, httpx.Response]:
        """The first response below 500 from a healthy instance, trying each at most once.

        Instances are tried in the route's order (InstancePool.rank): the blocks they hold,
        the adapter the route's model may name, rendezvous order.

        With no healthy instance in the pool when the leg starts, the leg waits for one until
        `deadline` (router/pending.py). A streamed response keeps its instance's in-flight
        count until the caller releases it; otherwise the count is released here.
        """
        pool: InstancePool = self.pools[role]
        leg = leg or role
        content = None if body is None else json.dumps(body).encode()
        await self.holding.until_ready(pool, deadline)
        tried: set[str] = set()
        while (instance := pool.pick(route, exclude=tried)) is not None:
            tried.add(instance.url)
            request = self.client.build_request(
                method, instance.endpoint(path), content=content, headers=headers, timeout=timeout
            )
            instance.in_flight += 1
            try:
                response = await self.client.send(request, stream=stream)
            except (httpx.ConnectTimeout, httpx.ConnectError) as error:
                self._failed(pool, instance, leg, f"cannot connect: {error!r}")
                await self._replacement(pool, deadline, tried)
                continue
            except httpx.TimeoutException:
                instance.in_flight -= 1
                self.metrics.requests.labels(leg, "timeout").inc()
                raise errors.gateway_timeout(role, instance.url, timeout.read or 0) from None
            except httpx.TransportError as error:
                # It accepted the connection and then dropped it: the process died, perhaps
                # while running this request, which then fails (a 503 once none is left)
                # rather than waiting for a restart to run it again.
                self._failed(pool, instance, leg, f"dropped the connection: {error!r}")
                continue
            except BaseException:  # cancelled: the client went away
                instance.in_flight -= 1
                raise
            self.metrics.requests.labels(leg, str(response.status_code)).inc()
            if response.status_code >= 500:
                await response.aclose()
                instance.in_flight -= 1
                pool.mark_down(instance, f"{method} {path} answered {response.status_code}")
                if DRAINING_HEADER in response.headers:
                    # It was told to stop (a scale-down, say) and ran nothing of this request.
                    await self._replacement(pool, deadline, tried)
                continue
            if not stream:
                instance.in_flight -= 1
            return instance, response
        raise errors.no_instance(pool, self.retry_after_s)

    async def _replacement(self, pool: InstancePool, deadline: float, tried: set[str]) -> None:
        """After the pool's last healthy instance refused this leg before running any of it
        (nobody listening, or told to stop, before the router's checks saw it go: a rollout,
        a scale-down), wait for one that replaces it, as a leg that starts at an empty pool
        does, and try again from there; with other healthy instances left, the leg goes on to
        those."""
        if not pool.healthy():
            await self.holding.until_ready(pool, deadline)
            tried.clear()

    def _failed(self, pool: InstancePool, instance: Instance, leg: str, reason: str) -> None:
        instance.in_flight -= 1
        self.metrics.requests.labels(leg, "error").inc()
        pool.mark_down(instance, reason)


def _copy(response: httpx.Response) -> Response:
    """A read upstream response as the client's response."""
    return Response(response.content, response.status_code, headers=relayed_headers(response))
