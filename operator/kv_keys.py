"""The CURVE key pair that encrypts a disaggregated LLMDeployment's KV transfer.

One pair per resource, shared by both pools (engine/kv_transfer/zmq_curve.py says how the
engines use it). The reconcile creates it in the Secret `<name>-kv-curve`, owned by the
resource so that it goes with it, before the pools that mount it. It is never rotated behind
the pods' backs: a Secret of that name that exists is kept as it is, whoever made it. The
operator may create Secrets and do nothing else with them. It never reads one, so it cannot
leak a key either. `tidegate up` makes a pair of its own on the machine (`write_key_dir`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidegate.engine.config import KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE


def new_key_pair() -> dict[str, str]:
    """A fresh Curve25519 key pair by file name, Z85-encoded, from libzmq's own generator."""
    import zmq  # the operator extra's pyzmq: `tidegate plan` renders without it

    public, secret = zmq.curve_keypair()
    return {KV_CURVE_PUBLIC_KEY_FILE: public.decode(), KV_CURVE_SECRET_KEY_FILE: secret.decode()}


def key_secret(described: Mapping[str, Any]) -> dict[str, Any]:
    """The Secret `render` describes (`Rendered.kv_keys`), holding a fresh key pair."""
    return {**described, "stringData": new_key_pair()}


def write_key_dir(folder: Path) -> None:
    """A key pair in `folder`, readable by this user only, unless the folder holds one."""
    names = (KV_CURVE_PUBLIC_KEY_FILE, KV_CURVE_SECRET_KEY_FILE)
    if all((folder / name).is_file() for name in names):
        return
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, key in new_key_pair().items():
        path = folder / name
        path.touch(mode=0o600)
        path.write_text(key + "\n")
