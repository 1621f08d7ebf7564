"""CURVE on the KV transfer's TCP sockets (`--kv-encryption curve`).

One key pair per deployment, shared by both pools (the operator keeps it in the Secret
`<name>-kv-curve`). A producer's listening sockets are CURVE servers with it. A consumer's
sockets are CURVE clients that expect the producer's public key and present the same pair
as their own. CURVE alone admits any client that knows the server's public key, and a public
key is not a secret. So each context that listens also runs a ZAP handler (RFC 27), which
admits only clients whose long-term public key is the deployment's. The handshake proves
that the client holds the matching secret key.

The key files hold one Z85 key each (40 characters), as `zmq.curve_keypair()` makes them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

from tidegate.engine.config import KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE

logger = logging.getLogger(__name__)

# Where libzmq asks a context's ZAP handler about each handshake (RFC 27).
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"tidegate-kv"
# Refused handshakes are logged at most this often: a consumer with another key retries its
# connection every 100 ms.
_WARN_EVERY_S = 60.0


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's key pair, Z85-encoded."""

    public: bytes
    secret: bytes = field(repr=False)  # out of logs and tracebacks


def load_curve_keys(key_dir: str) -> CurveKeys:
    """The key pair in `key_dir`; ValueError saying what is wrong (never the secret key)."""
    if not zmq.has("curve"):
        raise ValueError(
            f"kv_encryption curve needs libzmq built with CURVE; libzmq "
            f"{zmq.zmq_version()} here has none"
        )
    folder = Path(key_dir)
    keys = {}
    for name in (KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE):
        path = folder / name
        try:
            text = path.read_text(errors="replace").strip()
        except OSError as error:
            raise ValueError(f"kv_curve_key_dir: cannot read {path}: {error.strerror}") from None
        if len(text) != 40 or not text.isascii():
            raise ValueError(f"{path} does not hold a CURVE key (40 Z85 characters)")
        keys[name] = text.encode()
    public, secret = keys[KV_CURVE_PUBLIC_KEY_FILE], keys[KV_CURVE_SECRET_KEY_FILE]
    try:
        derived = zmq.curve_public(secret)
    except zmq.ZMQError:
        raise ValueError(f"{folder / KV_CURVE_SECRET_KEY_FILE} is not a Z85 CURVE key") from None
    if derived != public:
        raise ValueError(
            f"{folder}: {KV_CURVE_PUBLIC_KEY_FILE} is not the public key of "
            f"{KV_CURVE_SECRET_KEY_FILE} (files of two different key pairs)"
        )
    return CurveKeys(public, secret)


def curve_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a listening socket a CURVE server; bind a ZapHandler in its context first."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN
    # Refuse every client should the handler be gone, rather than admit any.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def curve_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a connecting socket a CURVE client of the deployment's producers (before connect)."""
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


class ZapHandler:
    """A context's ZAP handler: admits a CURVE client only with the deployment's public key.

    libzmq sends it a request, over inproc, for each handshake of the context's CURVE
    servers. The thread that owns those servers polls `socket` and calls `answer`; until it
    does, the handshake waits.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self.socket = ctx.socket(zmq.REP)
        self.socket.bind(ZAP_ENDPOINT)
        self._allowed = z85.decode(keys.public)
        self._refused = 0
        self._warned_at = -math.inf

    def answer(self) -> None:
        """Answer one request: 200 for the deployment's key, 400 for any other client."""
        frames = self.socket.recv_multipart()
        # version, request id, domain, address, routing id, mechanism, client key
        request_id = frames[1] if len(frames) > 1 else b""
        admitted = (
            len(frames) == 7
            and frames[0] == b"1.0"
            and frames[5] == b"CURVE"
            and frames[6] == self._allowed
        )
        status = (b"200", b"OK") if admitted else (b"400", b"not this deployment's KV key")
        self.socket.send_multipart([b"1.0", request_id, *status, b"", b""])
        if not admitted:
            self._warn(frames[3].decode(errors="replace") if len(frames) > 3 else "?")

    def _warn(self, address: str) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            logger.warning(
                "KV transfer refused %d connection(s), the last from %s: the client did not "
                "present this deployment's CURVE key",
                self._refused,
                address,
            )
            self._refused, self._warned_at = 0, now

    def close(self) -> None:
        self.socket.close(linger=0)
