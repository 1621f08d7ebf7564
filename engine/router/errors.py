"""The errors the router itself answers with, in OpenAI's error body."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from tidegate.engine.entrypoints.openai.errors import OpenAIError
from tidegate.engine.router.instances import InstancePool


def no_instance(pool: InstancePool, retry_after_s: float) -> OpenAIError:
    """503: every instance of a role is down, or was tried for this request and failed."""
    if len(pool) == 0:
        detail = "none is known (its URLs resolved to no address)"
    else:
        errors = "; ".join(f"{i.url}: {i.last_error or 'failed'}" for i in pool)
        detail = f"{len(pool)} known, none usable ({errors})"
    return _unavailable(f"no healthy {pool.role} instance: {detail}", retry_after_s)


def queue_full(pool: InstancePool, max_pending: int, retry_after_s: float) -> OpenAIError:
    """503: no instance of a role is healthy and its queue of held requests is full."""
    return _unavailable(
        f"no healthy {pool.role} instance, and {max_pending} requests already wait for one "
        f"(--max-pending {max_pending})",
        retry_after_s,
    )


def pending_timeout(pool: InstancePool, timeout_s: float, retry_after_s: float) -> OpenAIError:
    """503: a held request waited its --pending-timeout and no instance of its role came."""
    return _unavailable(
        f"no {pool.role} instance became healthy within {timeout_s:g} s (--pending-timeout)",
        retry_after_s,
    )


def no_instance_in_subset(
    pool: InstancePool, subset: Sequence[str], retry_after_s: float
) -> OpenAIError:
    """503: the gateway's subset hint names no healthy instance of the pool (or nothing)."""
    if not subset:
        return _unavailable("the gateway's endpoint subset is empty", retry_after_s)
    return _unavailable(
        f"no healthy {pool.role} instance in the gateway's endpoint subset ({', '.join(subset)})",
        retry_after_s,
    )


def shed(least_load: float, limit: float, retry_after_s: float) -> OpenAIError:
    """429: even the least loaded instance carries the endpoint picker's shedding load."""
    after = retry_after(retry_after_s)
    return OpenAIError(
        429,
        f"every instance is busy: the least loaded carries {least_load:g} requests, at or above "
        f"{limit:g} (--epp-shed-load); retry after {after} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": after},
    )


def tenant_limit(in_flight: int, limit: int, per_instance: int) -> OpenAIError:
    """429: the tenant has as many requests in flight as the instances would hold of it."""
    return OpenAIError(
        429,
        f"this tenant has {in_flight} requests in flight, at its limit of {limit} "
        f"({per_instance} per healthy instance: --max-running-per-tenant plus "
        "--max-waiting-per-tenant); retry after 1 s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


def _unavailable(message: str, retry_after_s: float) -> OpenAIError:
    """A 503 that says when to retry, in the message and in Retry-After."""
    after = retry_after(retry_after_s)
    return OpenAIError(
        503,
        f"{message}; retry after {after} s",
        type="server_error",
        headers={"Retry-After": after},
    )


def gateway_timeout(role: str, url: str, timeout_s: float) -> OpenAIError:
    """504: an instance accepted the request but did not answer in time."""
    return OpenAIError(
        504, f"{role} instance {url} did not answer within {timeout_s:g} s", type="server_error"
    )


def bad_gateway(message: str) -> OpenAIError:
    """502: an instance answered something the router cannot use."""
    return OpenAIError(502, message, type="server_error")


def not_json(detail: str) -> OpenAIError:
    """400: the client's body is not a JSON object."""
    return OpenAIError(400, f"the request body must be a JSON object: {detail}")


def body_too_large(limit: int) -> OpenAIError:
    """413: a body larger than the endpoint picker buffers."""
    return OpenAIError(413, f"the request body is larger than {limit:,} bytes")


def sse_error_event(message: str) -> bytes:
    """The SSE event that tells a streaming client its stream ends in an error."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n".encode()


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))
