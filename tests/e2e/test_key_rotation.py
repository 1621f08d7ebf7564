"""An API key rotated under load, the way a Secret changes in a pod: no request fails, and the
old key is refused soon after it leaves the file. One `tidegate serve`, and one `tidegate
router` in front of it, each reading a key file laid out and swapped as the kubelet does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import SERVED_NAME
from tests.e2e.server import ServerProcess
from tests.engine.entrypoints.secret_volume import SecretVolume
from tidegate.common.local_server import LocalServer
from tidegate.engine.entrypoints.openai.auth import KEY_FILE_POLL_S

START_KEY = "sk-rotation-start-5e0b"
CLIENTS = 8
# How long the clients send requests in each stage: old key alone, both, new key alone.
STAGE_S = 2.0
# Within this a change of the file is in effect: one poll, and room for a busy machine.
TAKE_UP_S = KEY_FILE_POLL_S + 4.0


@dataclass
class Secrets:
    engine: SecretVolume
    router: SecretVolume


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Secrets:
    found = Secrets(
        SecretVolume(tmp_path_factory.mktemp("engine-secret")),
        SecretVolume(tmp_path_factory.mktemp("router-secret")),
    )
    found.engine.write(f"{START_KEY}\n")
    found.router.write(f"{START_KEY}\n")
    return found


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, secrets: Secrets
) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_llama_dir,
        tmp_path_factory.mktemp("logs"),
        "--served-model-name",
        SERVED_NAME,
        "--api-key-file",
        str(secrets.engine.path),
    )
    try:
        yield proc.wait_healthy()
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def router(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory, secrets: Secrets
) -> Iterator[LocalServer]:
    log = tmp_path_factory.mktemp("router-logs") / "router.log"
    proc = LocalServer.tidegate_router(
        [], [server.base_url], "--api-key-file", str(secrets.router.path), log=log
    )
    try:
        yield proc.wait_healthy(60.0)
    finally:
        assert proc.stop() == 0, proc.log()


@dataclass
class Load:
    """Clients that send completions, half of them streamed, with whichever key is current."""

    base_url: str
    key: str
    answers: list[tuple[str, int, str]] = field(default_factory=list)  # key, status, failure
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, number: int) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60.0) as http:
            sent = 0
            while not self.stop.is_set():
                key, stream = self.key, (number + sent) % 2 == 0
                body = {"model": SERVED_NAME, "prompt": f"tide {number} {sent}", "max_tokens": 8}
                headers = {"Authorization": f"Bearer {key}"}
                try:
                    response = await http.post(
                        "/v1/completions", json={**body, "stream": stream}, headers=headers
                    )
                    text = response.text
                except httpx.HTTPError as error:
                    self.answers.append((key, 0, repr(error)))
                else:
                    complete = not stream or (
                        text.endswith("data: [DONE]\n\n") and '"error"' not in text
                    )
                    self.answers.append((key, response.status_code, "" if complete else text))
                sent += 1

    def failures(self) -> list[tuple[str, int, str]]:
        return [a for a in self.answers if a[1] != 200 or a[2]]

    def count(self, key: str) -> int:
        return sum(1 for a in self.answers if a[0] == key)


async def status(http: httpx.AsyncClient, key: str) -> int:
    response = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    return response.status_code


async def seconds_until(http: httpx.AsyncClient, key: str, code: int) -> float:
    """How long until a request with `key` is answered `code`; fails past TAKE_UP_S."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while (answer := await status(http, key)) != code:
        waited = loop.time() - start
        assert waited < TAKE_UP_S, f"still {answer} for a key after {waited:.1f} s"
        await asyncio.sleep(0.05)
    return loop.time() - start


async def rotate_under_load(base_url: str, volume: SecretVolume, old: str, new: str) -> Load:
    """Old key alone, then old and new, clients moved to the new, then the new alone."""
    load = Load(base_url, old)
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as http:
        volume.write(f"{old}\n")
        await seconds_until(http, old, 200)
        await seconds_until(http, new, 401)
        clients = [asyncio.create_task(load.client(n)) for n in range(CLIENTS)]
        await asyncio.sleep(STAGE_S)
        volume.write(f"# {old} goes once every client has {new}\n{old}\n{new}\n")
        await seconds_until(http, new, 200)
        load.key = new
        await asyncio.sleep(STAGE_S)
        volume.write(f"{new}\n")
        refused_in = await seconds_until(http, old, 401)
        await asyncio.sleep(STAGE_S)
        load.stop.set()
        await asyncio.gather(*clients)
        for _ in range(5):  # refused for good, not once
            assert await status(http, old) == 401 and await status(http, new) == 200
    print(f"old key refused {refused_in:.2f} s after the swap; {len(load.answers)} requests")
    return load


def check(load: Load, old: str, new: str) -> None:
    assert load.failures() == []
    # Both keys carried load, streamed and not, and each stage held several requests at once.
    assert load.count(old) >= CLIENTS and load.count(new) >= 2 * CLIENTS


def test_the_engine_rotates_its_key_under_load_with_no_failed_request(server, secrets):
    old, new = "sk-engine-old-31f7", "sk-engine-new-c04a"
    load = asyncio.run(rotate_under_load(server.base_url, secrets.engine, old, new))
    check(load, old, new)
    log = server.log()
    assert "changed: keys valid now: 2 (1 added, 0 removed)" in log
    assert old not in log and new not in log


def test_the_router_rotates_its_key_under_load_with_no_failed_request(server, router, secrets):
    old, new = "sk-router-old-9b22", "sk-router-new-7d85"
    # The engine takes both throughout: every 401 below is the router's own.
    secrets.engine.write(f"{old}\n{new}\n")
    load = asyncio.run(rotate_under_load(router.base_url, secrets.router, old, new))
    check(load, old, new)
    log = router.log()
    assert "changed: keys valid now: 2 (1 added, 0 removed)" in log
    assert old not in log and new not in log
