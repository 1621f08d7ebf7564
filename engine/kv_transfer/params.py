"""`kv_transfer_params`: what a request asks of a KV transfer, and what a producer answers.

The router sends `{"do_remote_decode": true}` to a prefill instance (the producer). The
producer's response carries the params below, with `do_remote_prefill`, which the router
passes on to a decode instance (the consumer): where the pinned blocks are and how to name
them. The consumer checks `prompt_digest` against its own tokens, so a pool whose tokenizer
or chat template differs falls back to computing the prompt instead of reading wrong KV.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class RemoteDecode(BaseModel):
    """Producer side: compute the prompt, keep its blocks for a consumer, say where they are."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    do_remote_decode: Literal[True]


class RemotePrefill(BaseModel):
    """Consumer side: the prompt's KV was computed by a producer; pull it, then decode."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    do_remote_prefill: Literal[True]
    remote_engine_id: str = Field(min_length=1, max_length=256)
    remote_request_id: str = Field(min_length=1, max_length=512)
    remote_host: str = Field(min_length=1, max_length=253)
    remote_port: int = Field(ge=1, le=65535)
    remote_data_ports: list[int] = Field(min_length=1, max_length=512)
    remote_block_ids: list[int]
    remote_block_size: int = Field(ge=1)
    remote_tp_size: int = Field(ge=1)
    prompt_digest: str = Field(min_length=1, max_length=128)
    # The LoRA adapter the producer computed the prompt under (None: the base model).
    lora_name: str | None = Field(None, max_length=256)
    lora_digest: str | None = Field(None, max_length=128)


KVTransferParams = RemoteDecode | RemotePrefill


def parse_kv_transfer_params(raw: dict[str, Any] | None) -> KVTransferParams | None:
    """Typed params from a request body's object; ValueError naming what is wrong."""
    if not raw:
        return None
    if raw.get("do_remote_decode") and raw.get("do_remote_prefill"):
        raise ValueError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other"
        )
    model: type[BaseModel]
    if raw.get("do_remote_decode"):
        model = RemoteDecode
    elif raw.get("do_remote_prefill"):
        model = RemotePrefill
    else:
        raise ValueError(
            "kv_transfer_params must set do_remote_decode (prefill instance) or "
            "do_remote_prefill with the prefill instance's answer (decode instance)"
        )
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(f"kv_transfer_params: {problems}") from None


def prompt_digest(token_ids: list[int]) -> str:
    """A short fingerprint of the prompt tokens both sides must agree on."""
    data = b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data).hexdigest()[:32]
