"""Server-sent events: one line each whatever the text, and one write per batch of events.

What the engine produced for a response since its last write (several steps when the reader
fell behind, one token per choice with n > 1) goes out in one write, each chunk still its own
event, so the bytes a client reads are those it read when every event was a write.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.engine.entrypoints.fake_engine import MODEL, body_writes, events_of
from tidegate.engine.async_llm import AsyncLLM
from tidegate.engine.data_parallel import DataParallelRouter
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.entrypoints.openai.responses import CompletionChoice, CompletionResponse
from tidegate.engine.entrypoints.openai.sse import sse_event
from tidegate.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LogprobsLists,
)
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.tokenizer import Tokenizer

# Characters JSON leaves as they are but str.splitlines() breaks lines at.
UNICODE_LINE_BREAKS = "\x85\u2028\u2029"


@pytest.mark.parametrize("as_model", [True, False], ids=["chunk", "error body"])
def test_an_event_with_unicode_line_breaks_in_its_text_is_one_line(as_model):
    # A byte-level model can generate any of them; a client reading the stream with httpx's
    # aiter_lines (str.splitlines) must still see one `data:` line per event.
    text = f"a{UNICODE_LINE_BREAKS}b\x0b\x1cc"
    choice = CompletionChoice(index=0, text=text, finish_reason=None)
    chunk = CompletionResponse(id="cmpl-1", created=0, model="tiny", choices=[choice])
    payload = chunk if as_model else {"error": {"message": text}}

    lines = sse_event(payload).splitlines()

    assert lines[1:] == [""]
    assert lines[0].startswith("data: ")
    decoded = json.loads(lines[0][len("data: ") :])
    assert (decoded["choices"][0]["text"] if as_model else decoded["error"]["message"]) == text


def writes_of(app, path: str, body: dict) -> list[bytes]:
    writes = asyncio.run(body_writes(app, path, {"model": MODEL, "stream": True, **body}))
    assert all(write.endswith(b"\n\n") for write in writes)  # whole events only
    return writes


def test_steps_queued_for_a_reader_go_out_in_one_write_with_their_events_unchanged(app, engine):
    body = {"prompt": "a", "max_tokens": 7}
    one_by_one = writes_of(app, "/v1/completions", body)
    engine.steps_per_item = 3  # the reader fell three engine steps behind
    batched = writes_of(app, "/v1/completions", body)

    assert len(one_by_one) == 7 + 1  # a write per token, then [DONE]
    assert len(batched) == 3 + 1  # 3 + 3 + 1 tokens, then [DONE]
    assert [w.count(b"data: ") for w in batched] == [3, 3, 1, 1]
    events = events_of(batched)
    assert events == events_of(one_by_one)
    assert len(events) == 7 + 1
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == engine.tokenizer.decode(engine.script_ids[:7])
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * 6 + ["length"]


def test_the_choices_of_one_step_share_a_write_and_usage_ends_the_last(app, engine):
    body = {"prompt": "a", "max_tokens": 4, "n": 3, "stream_options": {"include_usage": True}}
    writes = writes_of(app, "/v1/completions", body)
    events = events_of(writes)

    # A write per step holding the three choices' tokens; the last also holds the usage.
    assert [w.count(b"data: ") for w in writes] == [3, 3, 3, 3 + 1, 1]
    *chunks, usage, done = events
    assert done == "[DONE]" and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == engine.tokenizer.decode(engine.script_ids[:4])
        assert [c["finish_reason"] for c in mine] == [None, None, None, "length"]


def test_chat_roles_go_out_together_and_queued_steps_with_logprobs_stay_whole(app, engine):
    engine.steps_per_item = 2
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    writes = writes_of(app, "/v1/chat/completions", body)
    events = events_of(writes)

    assert [w.count(b"data: ") for w in writes] == [2, 2 * 2, 2 * 1 + 1, 1]
    roles, (*chunks, usage, done) = events[:2], events[2:]
    assert [r["choices"][0]["delta"] for r in roles] == [{"role": "assistant", "content": ""}] * 2
    for index in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert len(mine) == 3  # an event per step, as when every step was a write
        tokens = [t for c in mine for t in c["logprobs"]["content"]]
        assert [t["token"] for t in tokens] == [
            engine.tokenizer.decode([t]) for t in engine.script_ids[:3]
        ]
        assert "".join(c["delta"].get("content", "") for c in mine) == "".join(
            t["token"] for t in tokens
        )
    assert usage["usage"]["completion_tokens"] == 6 and done == "[DONE]"


class FakeCore:
    """Stands in for an EngineCoreClient: records what AsyncLLM sends it."""

    dead_reason = None
    max_waiting_requests = None

    def __init__(self) -> None:
        self.added = asyncio.Event()
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []

    async def add_request(self, request: EngineCoreRequest) -> None:
        self.requests.append(request)
        self.added.set()

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


async def wait_for_writes(writes: list[bytes], count: int) -> None:
    for _ in range(1000):
        if len(writes) >= count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{len(writes)} writes, not {count}")


def test_steps_a_slow_reader_missed_are_one_write_through_async_llm(tiny_llama_dir):
    # The real output processor (detokenizer, stop string, logprobs) behind the real app.
    tokenizer = Tokenizer(tiny_llama_dir)
    ids = tokenizer.encode(" the cat sat on the mat and", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids[2:4]] == [" s", "at"]  # "sat" spans two steps

    async def run() -> tuple[list[bytes], FakeCore]:
        core = FakeCore()
        engine = AsyncLLM(
            ModelConfig.from_pretrained(tiny_llama_dir),
            tokenizer,
            [core],  # type: ignore[list-item]
            max_model_len=256,
            block_size=16,
            router=DataParallelRouter(1, max_hashes_per_core=64),
            metrics=None,
        )
        app = build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir))
        body = {"prompt": "a", "max_tokens": 50, "stop": ["mat"], "logprobs": 1}
        writes: list[bytes] = []
        response = asyncio.ensure_future(
            body_writes(app, "/v1/completions", {"model": MODEL, "stream": True, **body}, writes)
        )
        await core.added.wait()
        request_id = core.requests[0].request_id

        def step(token: int) -> EngineCoreOutputs:
            logprobs = LogprobsLists([[token, 7]], [[-0.5, -2.0]], [1])
            return EngineCoreOutputs(
                0, [EngineCoreOutput(request_id, [token], None, None, logprobs)]
            )

        for token in ids[:3]:  # three steps before the reader runs
            engine._handle_outputs(step(token))
        await wait_for_writes(writes, 1)
        for token in ids[3:]:  # the rest, "mat" among them
            engine._handle_outputs(step(token))
        return await response, core

    writes, core = asyncio.run(run())

    assert [w.count(b"data: ") for w in writes] == [3, 4, 1]  # " mat" ends it; " and" is never read
    events = events_of(writes)[:-1]
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == " the cat sat on the "
    assert [c["finish_reason"] for c in choices] == [None] * 6 + ["stop"]
    assert choices[-1]["stop_reason"] == "mat"
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert tokens == [tokenizer.decode([i]) for i in ids[:7]]
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(7)]
    assert core.aborted == [core.requests[0].request_id]  # the engine stops what the stop ended
