"""CURVE on the KV transfer (--kv-encryption curve): what an eavesdropper sees, who gets in.

The transport's worker side on its own (real sockets, no model), then a producer and a
consumer EngineCore in this process whose KV traffic goes through a recording TCP relay,
the eavesdropper: it sees plaintext without encryption, and none with it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.engine.kv_transfer.test_kv_transfer_engines import (
    all_free,
    core_request,
    decode_with,
    drive,
    engine_args,
    greedy,
    make_prompt,
    prefill_remotely,
    wait_until,
)
from tests.engine.kv_transfer.test_zmq_transport import HEADS, LAYERS, caches
from tidegate.engine.config import (
    KV_CURVE_PUBLIC_KEY_FILE,
    KV_CURVE_SECRET_KEY_FILE,
    EngineArgs,
    ServerArgs,
)
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.entrypoints.serve import _check_roles
from tidegate.engine.kv_transfer.zmq_curve import load_curve_keys
from tidegate.engine.kv_transfer.zmq_worker import ZmqConnectorWorker
from tidegate.engine.messages import (
    KVConnectorMetadata,
    KVReadReply,
    KVReadRequest,
    KVRecvDone,
    KVRecvSpec,
    KVWorkerConfig,
)
from tidegate.operator.kv_keys import write_key_dir


def test_this_libzmq_has_curve() -> None:
    assert zmq.has("curve")


# -- keys ---------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """The deployment's key pair, as the operator's Secret mounts it."""
    write_key_dir(tmp_path / "deployment")
    return tmp_path / "deployment"


@pytest.fixture
def other_keys(tmp_path: Path) -> Path:
    """Another deployment's key pair."""
    write_key_dir(tmp_path / "other")
    return tmp_path / "other"


def test_key_files_that_cannot_be_used_are_refused_without_showing_the_secret(
    keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    secret = (keys / KV_CURVE_SECRET_KEY_FILE).read_text().strip()
    assert load_curve_keys(str(keys)).public == (keys / KV_CURVE_PUBLIC_KEY_FILE).read_bytes()[:40]
    assert secret not in repr(load_curve_keys(str(keys)))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / KV_CURVE_PUBLIC_KEY_FILE).write_text(
        (other_keys / KV_CURVE_PUBLIC_KEY_FILE).read_text()
    )
    (mixed / KV_CURVE_SECRET_KEY_FILE).write_text(secret)
    cases = {
        str(tmp_path / "absent"): "cannot read",
        str(mixed): "is not the public key of secret.key",
    }
    short = tmp_path / "short"
    write_key_dir(short)
    (short / KV_CURVE_SECRET_KEY_FILE).write_text(secret[:-1])
    cases[str(short)] = "does not hold a CURVE key"
    for folder, words in cases.items():
        with pytest.raises(ValueError, match=words) as refused:
            load_curve_keys(folder)
        assert secret not in str(refused.value)


def test_curve_needs_a_key_folder_and_serve_checks_it_before_the_model_loads(
    keys: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="kv_encryption curve needs kv_curve_key_dir"):
        EngineArgs(model="m", kv_role="producer", kv_encryption="curve")
    with pytest.raises(ValueError, match="kv_curve_key_dir is read only with kv_encryption curve"):
        EngineArgs(model="m", kv_role="producer", kv_curve_key_dir=str(keys))
    args = EngineArgs(
        model="m", kv_role="consumer", kv_encryption="curve", kv_curve_key_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"cannot read .*public\.key"):
        _check_roles(args, ServerArgs())


# -- the worker side, real sockets ----------------------------------------------------------


@contextlib.contextmanager
def worker(
    role: str, events_address: str, key_dir: Path | None, timeout_s: float = 30.0
) -> Iterator[ZmqConnectorWorker]:
    config = KVWorkerConfig("zmq", role, 0, events_address, timeout_s, str(key_dir or ""))
    rank = ZmqConnectorWorker(
        config, rank=0, tp_size=1, num_kv_heads=HEADS, device=torch.device("cpu")
    )
    try:
        rank.register_kv_caches(caches(fill=role == "producer"))
        yield rank
    finally:
        rank.shutdown()


def pull(
    consumer: ZmqConnectorWorker, producer: ZmqConnectorWorker, sock: zmq.Socket
) -> KVRecvDone:
    producer.update_pins({"t": [1, 3]}, [])
    spec = KVRecvSpec("r", "t", "127.0.0.1", [producer.data_port], [3, 1], [0, 5])
    consumer.handle(KVConnectorMetadata(recv=[spec]))
    assert sock.poll(10_000), "no event from the puller"
    return msgspec.msgpack.decode(sock.recv(), type=KVRecvDone)


def test_a_consumer_with_the_deployments_keys_pulls_the_blocks(events, keys: Path) -> None:
    address, sock = events
    with (
        worker("producer", address, keys) as producer,
        worker("consumer", address, keys) as consumer,
    ):
        event = pull(consumer, producer, sock)
        assert event.ok, event.error
        consumer.handle(KVConnectorMetadata(load=["r"]))
        for (pk, pv), (ck, cv) in zip(producer.kv_caches, consumer.kv_caches, strict=True):
            assert torch.equal(ck[[0, 5]], pk[[3, 1]]) and torch.equal(cv[[0, 5]], pv[[3, 1]])


@pytest.mark.parametrize(
    ("producer_keys", "consumer_keys"),
    [("keys", "other_keys"), ("keys", None), (None, "keys")],
    ids=["another-key-pair", "plain-consumer", "plain-producer"],
)
def test_a_refused_handshake_fails_the_pull_at_once(
    events, request: pytest.FixtureRequest, producer_keys: str | None, consumer_keys: str | None
) -> None:
    """CURVE's refusals never reach the socket itself; the puller's monitor sees them, so the
    pull fails in a round trip instead of at its 30 s deadline."""
    address, sock = events
    folders = {name: request.getfixturevalue(name) for name in ("keys", "other_keys")}
    with (
        worker("producer", address, folders.get(producer_keys)) as producer,
        worker("consumer", address, folders.get(consumer_keys)) as consumer,
    ):
        started = time.monotonic()
        event = pull(consumer, producer, sock)
        assert not event.ok and "refused the handshake" in event.error
        assert time.monotonic() - started < 5.0
        assert not consumer._in_flight


def test_a_client_that_knows_the_public_key_but_not_the_secret_one_is_refused(
    events, keys: Path
) -> None:
    """The public key is not a secret: CURVE alone would admit anyone with a key pair of their
    own. The ZAP handler admits only the deployment's, which takes its secret key to prove."""
    address, _ = events
    deployment = load_curve_keys(str(keys))
    with worker("producer", address, keys) as producer:
        producer.update_pins({"t": [0]}, [])
        for own, admitted in (
            (zmq.curve_keypair(), False),
            ((deployment.public, deployment.secret), True),
        ):
            ctx = zmq.Context()
            client = ctx.socket(zmq.DEALER)
            client.curve_serverkey = deployment.public
            client.curve_publickey, client.curve_secretkey = own
            monitor = client.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
            try:
                client.connect(f"tcp://127.0.0.1:{producer.data_port}")
                read = KVReadRequest("t", [0], 0, HEADS)
                client.send_multipart([b"tag", msgspec.msgpack.encode(read)])
                assert monitor.poll(5_000), "no handshake outcome"
                event = recv_monitor_message(monitor)["event"]
                assert event == (
                    zmq.EVENT_HANDSHAKE_SUCCEEDED if admitted else zmq.EVENT_HANDSHAKE_FAILED_AUTH
                )
                if admitted:
                    assert client.poll(5_000)
                    _, header, *frames = client.recv_multipart()
                    assert msgspec.msgpack.decode(header, type=KVReadReply).ok
                    assert len(frames) == 2 * LAYERS
                else:
                    assert not client.poll(300)  # and no block was sent
            finally:
                client.disable_monitor()
                monitor.close(linger=0)
                client.close(linger=0)
                ctx.term()


# -- engines, through an eavesdropper --------------------------------------------------------


class RecordingRelay:
    """A TCP relay in front of a port that keeps every byte it forwards, both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._recorded = bytearray()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def recorded(self) -> bytes:
        with self._lock:
            return bytes(self._recorded)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            with self._lock:
                self._recorded += data
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


def curve(key_dir: Path) -> dict[str, str]:
    return {"kv_encryption": "curve", "kv_curve_key_dir": str(key_dir)}


@pytest.fixture(scope="module")
def unified(tiny_llama_dir: Path) -> Iterator[EngineCore]:
    engine = EngineCore(engine_args(tiny_llama_dir))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("encryption", ["none", "curve"])
def test_an_eavesdropper_on_the_kv_ports_sees_plaintext_only_without_encryption(
    tiny_llama_dir: Path, unified: EngineCore, keys: Path, encryption: str
) -> None:
    """Every byte between the two engines goes through a recording relay: the blocks' K
    bytes and the transfer id are in what it recorded in the clear, and nowhere with curve."""
    flags = curve(keys) if encryption == "curve" else {}
    producer = EngineCore(engine_args(tiny_llama_dir, kv_role="producer", **flags))
    consumer = EngineCore(engine_args(tiny_llama_dir, kv_role="consumer", **flags))
    relays: list[RecordingRelay] = []
    try:
        prompt = make_prompt(100, offset=11)
        expected = drive(unified, core_request("u-eaves", prompt, greedy(12)))["u-eaves"]["tokens"]
        params = prefill_remotely(producer, "p-eaves", prompt)
        connector = producer.executor.worker.kv_connector
        (k_cache, v_cache), layout = connector.kv_caches[0], connector.kv_layout
        # The first block's keys as they go on the wire: in the standard layout, whatever
        # the producer's attention backend caches (the cpu backend packs them).
        first = torch.tensor(params["remote_block_ids"][:1])
        keys, _ = layout.to_standard(k_cache.index_select(0, first), v_cache.index_select(0, first))
        block = keys[0].contiguous().numpy().tobytes()
        transfer_id = params["remote_request_id"].encode()
        relays = [RecordingRelay(params["remote_port"])]
        relays += [RecordingRelay(port) for port in params["remote_data_ports"]]
        through_relays = {
            **params,
            "remote_port": relays[0].port,
            "remote_data_ports": [relay.port for relay in relays[1:]],
        }
        assert decode_with(consumer, "c-eaves", prompt, through_relays, n=12) == expected
        assert consumer.stats()["kv_transfer_fallbacks"] == 0
        # The release notice came through the side channel's relay.
        wait_until(lambda: all_free(producer), producer)
        side, data = relays[0].recorded, b"".join(relay.recorded for relay in relays[1:])
        assert len(data) > len(block) and side  # both channels carried traffic
        seen = {"block": block in data, "read": transfer_id in data, "release": transfer_id in side}
        assert seen == dict.fromkeys(seen, encryption == "none")
    finally:
        for relay in relays:
            relay.close()
        producer.shutdown()
        consumer.shutdown()


def test_a_consumer_with_another_key_pair_computes_the_prompt_itself_at_once(
    tiny_llama_dir: Path, unified: EngineCore, keys: Path, other_keys: Path
) -> None:
    producer = EngineCore(
        engine_args(tiny_llama_dir, kv_role="producer", kv_transfer_timeout=2.0, **curve(keys))
    )
    consumer = EngineCore(
        engine_args(
            tiny_llama_dir, kv_role="consumer", kv_transfer_timeout=30.0, **curve(other_keys)
        )
    )
    try:
        prompt = make_prompt(60, offset=4)
        expected = drive(unified, core_request("u-wrong", prompt, greedy(10)))["u-wrong"]["tokens"]
        params = prefill_remotely(producer, "p-wrong", prompt)
        started = time.monotonic()
        assert decode_with(consumer, "c-wrong", prompt, params, n=10) == expected
        assert time.monotonic() - started < 10.0  # refused in a round trip, not after 30 s
        stats = consumer.stats()
        assert stats["kv_transfer_fallbacks"] == 1 and stats["kv_received_bytes"] == 0
        assert stats["num_computed_prompt_tokens"] == 60
        assert all_free(consumer)
        # Its release notice is refused too: the producer's pin expires on its own.
        wait_until(lambda: producer.stats()["kv_pins_expired"] == 1, producer, timeout_s=10.0)
        assert all_free(producer)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.slow
def test_worker_processes_read_the_keys_themselves(
    tiny_llama_dir: Path, unified: EngineCore, keys: Path
) -> None:
    """At two tensor-parallel ranks each worker is a process of its own: it is handed the key
    folder, never a key, and each rank's block server speaks CURVE."""
    producer = EngineCore(
        engine_args(tiny_llama_dir, kv_role="producer", tensor_parallel_size=2, **curve(keys))
    )
    consumer = EngineCore(engine_args(tiny_llama_dir, kv_role="consumer", **curve(keys)))
    try:
        prompt = make_prompt(130, offset=8)
        expected = drive(unified, core_request("u-tp", prompt, greedy(12)))["u-tp"]["tokens"]
        params = prefill_remotely(producer, "p-tp", prompt)
        assert len(params["remote_data_ports"]) == 2
        assert decode_with(consumer, "c-tp", prompt, params, n=12) == expected
        assert consumer.stats()["kv_transfer_fallbacks"] == 0
        wait_until(lambda: all_free(producer, consumer), producer)
    finally:
        producer.shutdown()
        consumer.shutdown()
