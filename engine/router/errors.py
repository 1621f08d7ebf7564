"""The errors the router itself answers with, in OpenAI's error body."""

from __future__ import annotations

import json
import math

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


def sse_error_event(message: str) -> bytes:
    """The SSE event that tells a streaming client its stream ends in an error."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n".encode()


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))
