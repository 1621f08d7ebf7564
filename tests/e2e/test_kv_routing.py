"""Routing by held blocks with real engines: the router hashes chat prompts as they do.

Three tiny-model instances publish their KV-cache events (`--kv-events-port 0`: each picks a
port and names it in /metrics); a router with `--tokenizer` follows them. A conversation is
first served by an instance the rendezvous order would not choose; the router then sends
the next turn, which starts with the same blocks once the chat template has rendered it, to
that instance. Restarting an instance empties its part of the index.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.client import finished, metric
from tests.e2e.server import ServerProcess
from tidegate.common.local_server import LocalServer
from tidegate.engine.entrypoints.openai.pd_bodies import CHAT_PATH
from tidegate.engine.router.routing import PromptTokenizer
from tidegate.engine.router.selection import affinity_key, rendezvous_order

MODEL = "tiny"
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "1024", "--kv-events-port", "0")


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("kv-routing")
    engines = [ServerProcess(tiny_llama_dir, logs, *FLAGS) for _ in range(3)]
    started: list[LocalServer] = list(engines)
    try:
        for engine in engines:
            engine.wait_healthy()
        router = LocalServer.tidegate_router(
            [],
            [e.base_url for e in engines],
            "--health-interval",
            "0.3",
            "--tokenizer",
            str(tiny_llama_dir),
            log=logs / "router.log",
        )
        started.append(router)
        router.wait_healthy(30.0)
        time.sleep(1.0)  # health rounds read each instance's events port and subscribe
        yield {"engines": engines, "router": router, "model": tiny_llama_dir}
    finally:
        # And any engine a test put in the list in place of one it stopped (a restart).
        started += [e for e in engines if e not in started]
        for server in reversed(started):
            server.stop()


def conversation(topic: int, turns: int) -> list[dict]:
    system = f"You answer questions about topic {topic}. " + " ".join(
        f"fact {topic}.{i} is worth remembering." for i in range(40)
    )
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} about {topic}?"})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {turn}."})
    return messages


def chat(url: str, messages: list[dict]) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    response = httpx.post(url + CHAT_PATH, json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_the_next_turn_goes_where_the_conversation_is_held(fleet: dict) -> None:
    engines, router = fleet["engines"], fleet["router"]
    urls = [e.base_url for e in engines]
    tokenizer = PromptTokenizer(str(fleet["model"]))
    moved = 0
    for topic in range(4):
        first = conversation(topic, 1)
        body = {"model": MODEL, "messages": conversation(topic, 2)}
        # The instance rendezvous hashing would choose for the next turn; serve the first
        # turn somewhere else, straight, so only the held blocks can lead the router there.
        order = rendezvous_order(affinity_key(body) or "", urls)
        preferred = order[0]
        holder = next(e for e in engines if e.base_url == order[1 + topic % 2])
        chat(holder.base_url, first)
        # The router's hashes of the next turn start with the first turn's blocks.
        ids = tokenizer.token_ids(CHAT_PATH, body)
        assert ids is not None and len(ids) > 64
        time.sleep(0.3)  # the stored events reach the router
        before = {e.base_url: finished(e.base_url) for e in engines}
        chat(router.base_url, conversation(topic, 2))
        after = {e.base_url: finished(e.base_url) for e in engines}
        went = [url for url in urls if after[url] > before[url]]
        assert went == [holder.base_url], (topic, went, holder.base_url, preferred)
        moved += 1
    assert moved == 4
    # The router says what it follows and what routing by it got: each next turn's first
    # turn was held, so most of its prompt.
    for engine in engines:
        assert metric(router.base_url, "tidegate:router_kv_index_synced", url=engine.base_url)
    assert metric(router.base_url, "tidegate:router_kv_index_blocks") > 0
    prompt = metric(router.base_url, "tidegate:router_routed_prompt_tokens_total")
    cached = metric(router.base_url, "tidegate:router_routed_cached_tokens_total")
    assert 0.5 * prompt < cached < prompt


def test_a_restarted_instance_holds_nothing_in_the_index(fleet: dict) -> None:
    engines, router = fleet["engines"], fleet["router"]
    body = {"model": MODEL, "messages": conversation(99, 2)}
    urls = [e.base_url for e in engines]
    preferred = rendezvous_order(affinity_key(body) or "", urls)[0]
    index = next(i for i, e in enumerate(engines) if e.base_url != preferred)
    target = engines[index]
    chat(target.base_url, conversation(99, 1))
    time.sleep(0.3)
    # Restart it on the same HTTP port: a new server, with a new events port and epoch.
    target.stop()
    log = target.log_path.with_name(f"restart-{target.port}.log") if target.log_path else None
    replacement = LocalServer(target.command, target.port, log=log)
    engines[index] = replacement
    replacement.wait_healthy(90.0)
    time.sleep(1.5)  # a health round reads the new port; the replay empties the index
    # Nothing of the conversation is held anywhere now: rendezvous order decides again.
    before = {e.base_url: finished(e.base_url) for e in engines}
    chat(router.base_url, conversation(99, 2))
    after = {e.base_url: finished(e.base_url) for e in engines}
    assert [u for u in urls if after[u] > before[u]] == [preferred]
