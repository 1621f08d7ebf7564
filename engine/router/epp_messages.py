"""The endpoint picker's vocabulary: Envoy's ext_proc messages, read and built.

The Gateway API Inference Extension's endpoint picker protocol rides on Envoy's external
processing service (envoy.service.ext_proc.v3). This module holds its names (headers and
metadata keys) and turns protobuf messages into plain values and back, so that the picker
itself (router/epp.py) deals in dicts, strings and OpenAI errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from tidegate.engine.entrypoints.openai.errors import OpenAIError
from tidegate.engine.entrypoints.openai.pd_bodies import PREFILLER_HEADER

# The protocol's names (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Where a decode engine started with --prefill-via-header runs the prompt's prefill leg.
PREFILL_HEADER = PREFILLER_HEADER

BodyMode = int
_MODES = processing_mode_pb2.ProcessingMode.BodySendMode
NONE: BodyMode = _MODES.Value("NONE")
STREAMED: BodyMode = _MODES.Value("STREAMED")
BUFFERED: BodyMode = _MODES.Value("BUFFERED")
BUFFERED_PARTIAL: BodyMode = _MODES.Value("BUFFERED_PARTIAL")
FULL_DUPLEX_STREAMED: BodyMode = _MODES.Value("FULL_DUPLEX_STREAMED")

# Envoy recommends body chunks of at most 64 KiB in FULL_DUPLEX_STREAMED; the GIE's picker
# keeps a margin under that, and so do we.
BODY_CHUNK_BYTES = 62_000


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Header name (lower case) -> value; Envoy sends values in raw_value, older ones in value."""
    found: dict[str, str] = {}
    for header in headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        found[header.key.lower()] = value
    return found


def filter_metadata(request: ext_proc.ProcessingRequest, namespace: str) -> dict[str, Any] | None:
    """One namespace of the request's metadata_context as plain values; None when absent."""
    if not request.HasField("metadata_context"):
        return None
    entries = request.metadata_context.filter_metadata
    if namespace not in entries:
        return None
    return json_format.MessageToDict(entries[namespace])


def subset_hint(request: ext_proc.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway lets us choose from; None: no hint, any of the pool.

    The protocol gives a list of `ip:port`; a string of comma-separated ones is read too, as
    some data planes copy a header into the metadata as it stands.
    """
    entry = filter_metadata(request, SUBSET_NAMESPACE)
    if entry is None or SUBSET_KEY not in entry:
        return None
    value = entry[SUBSET_KEY]
    items = value if isinstance(value, list) else [value]
    return [
        part.strip()
        for item in items
        if isinstance(item, str)
        for part in item.split(",")
        if part.strip()
    ]


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint the data plane reports as having served the request, if it says."""
    entry = filter_metadata(request, DESTINATION_NAMESPACE)
    value = entry.get(SERVED_KEY) if entry else None
    return value.strip() if isinstance(value, str) and value.strip() else None


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    """The dynamic metadata that names the endpoints, as the header does."""
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: endpoints}})
    return metadata


def header_mutation(
    set_headers: Mapping[str, str], remove: Iterable[str] = ()
) -> ext_proc.HeaderMutation:
    """Set (replacing any value the client sent) and remove headers; names in lower case."""
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    return ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key.lower(), raw_value=value.encode()),
                append_action=overwrite,
            )
            for key, value in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def headers_response(
    request_phase: bool,
    mutation: ext_proc.HeaderMutation | None = None,
    metadata: struct_pb2.Struct | None = None,
) -> ext_proc.ProcessingResponse:
    """The answer to a request or response headers message."""
    answer = ext_proc.HeadersResponse(response=_common_response(mutation))
    phase = "request_headers" if request_phase else "response_headers"
    return _processing_response(phase, answer, metadata)


def body_response(
    request_phase: bool,
    mutation: ext_proc.HeaderMutation | None = None,
    metadata: struct_pb2.Struct | None = None,
) -> ext_proc.ProcessingResponse:
    """The answer to one body message that leaves the body as it is (BUFFERED, STREAMED).

    A header mutation here takes effect only in BUFFERED mode, where Envoy holds the headers
    until the whole body has been processed.
    """
    answer = ext_proc.BodyResponse(response=_common_response(mutation))
    phase = "request_body" if request_phase else "response_body"
    return _processing_response(phase, answer, metadata)


def _common_response(mutation: ext_proc.HeaderMutation | None) -> ext_proc.CommonResponse:
    # Routing headers changed: Envoy must pick the route (and its cluster) again.
    return ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=mutation is not None)


def _processing_response(
    phase: str, answer: Any, metadata: struct_pb2.Struct | None
) -> ext_proc.ProcessingResponse:
    response = ext_proc.ProcessingResponse(**{phase: answer})
    if metadata is not None:
        response.dynamic_metadata.CopyFrom(metadata)
    return response


def streamed_body(
    request_phase: bool, body: bytes, end_of_stream: bool
) -> list[ext_proc.ProcessingResponse]:
    """`body` sent back in FULL_DUPLEX_STREAMED mode, where Envoy forwards only what we send.

    Cut in chunks of BODY_CHUNK_BYTES; the last carries `end_of_stream`. An empty body is one
    empty chunk, so that the end of the stream is still said.
    """
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    pieces = pieces or [b""]
    responses = []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        streamed = ext_proc.StreamedBodyResponse(body=piece, end_of_stream=end_of_stream and last)
        common = ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(streamed_response=streamed)
        )
        answer = ext_proc.BodyResponse(response=common)
        responses.append(
            ext_proc.ProcessingResponse(request_body=answer)
            if request_phase
            else ext_proc.ProcessingResponse(response_body=answer)
        )
    return responses


def trailers_response(request_phase: bool) -> ext_proc.ProcessingResponse:
    """The answer to a trailers message: no change."""
    answer = ext_proc.TrailersResponse()
    if request_phase:
        return ext_proc.ProcessingResponse(request_trailers=answer)
    return ext_proc.ProcessingResponse(response_trailers=answer)


def immediate_response(error: OpenAIError, details: str) -> ext_proc.ProcessingResponse:
    """Envoy answers the client itself with this error, in OpenAI's error body.

    `details` is what Envoy's access log shows as the response code details.
    """
    headers = {"content-type": "application/json", **error.headers}
    answer = ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=header_mutation(headers),
        body=json.dumps(error.body()).encode(),
        details=details,
    )
    return ext_proc.ProcessingResponse(immediate_response=answer)
