"""Chained content hashes of full KV blocks, stable across processes and Python runs.

Block i's hash covers its own tokens, its extra keys and block i-1's hash, so equal hashes
mean equal prefixes. Routers and prefill/decode instances compare these values across
processes, so they are sha256 over an explicit byte layout, never Python's `hash()`.
Changing the layout changes every hash: bump `_DOMAIN` when you do.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidegate.engine.core.request import Request

# Domain separation: a block hash can never equal a sha256 computed for another purpose.
_DOMAIN = b"tidegate.kv-block.v1\x00"
_U32 = struct.Struct("<I")


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """Hash one full block from its parent's hash, its token ids and its extra keys."""
    h = hashlib.sha256(_DOMAIN)
    h.update(_encode(parent_hash))
    h.update(_U32.pack(len(token_ids)))
    # Signed 64-bit little-endian: fixed width, so no token boundary is ambiguous.
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(_encode(extra_keys))
    return h.digest()


def block_extra_keys(
    cache_salt: str | None, block_index: int, lora_digest: str | None = None
) -> tuple | None:
    """Extra keys of a request's block: its cache salt and its LoRA adapter's digest, on the
    first block only."""
    # They only need to enter the first block: chaining carries them to every later one, so
    # two salts (or a salt and none), or two adapters (or one and the base model), never share
    # any block. Without an adapter the key is the same as before adapters existed.
    if block_index != 0:
        return None
    if lora_digest is not None:
        return (cache_salt, ("lora", lora_digest))
    if cache_salt is not None:
        return (cache_salt,)
    return None


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Append to `request.block_hashes` the hashes of its newly full blocks."""
    lora = request.lora_request
    append_block_hashes(
        request.block_hashes,
        request.all_token_ids,
        block_size,
        request.cache_salt,
        lora.digest if lora is not None else None,
    )


def append_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    lora_digest: str | None = None,
) -> None:
    """Append to `hashes` those of the full blocks of `token_ids` that it does not hold yet."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i > 0 else None
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        extra = block_extra_keys(cache_salt, i, lora_digest)
        hashes.append(hash_block_tokens(parent, tokens, extra))


def _encode(value: object) -> bytes:
    """Serialize a key value with a type tag and a length, so distinct values never collide."""
    if value is None:
        return b"N"
    if isinstance(value, bytes):
        return b"B" + _U32.pack(len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"S" + _U32.pack(len(data)) + data
    if isinstance(value, bool):  # before int: bool is an int subclass
        return b"T" if value else b"F"
    if isinstance(value, int):
        data = str(value).encode("ascii")
        return b"I" + _U32.pack(len(data)) + data
    if isinstance(value, tuple):
        return b"(" + _U32.pack(len(value)) + b"".join(_encode(v) for v in value)
    raise TypeError(
        f"block hash extra key of type {type(value).__name__} is not supported; "
        "use None, bool, int, str, bytes or tuples of them"
    )
