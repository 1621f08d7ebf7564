"""AsyncLLM against a real engine core process: deltas add up, aborts end streams."""

from __future__ import annotations

import asyncio

import pytest

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.async_llm import AsyncLLM
from tidegate.engine.config import EngineArgs
from tidegate.engine.data_parallel import DataParallelRouter
from tidegate.engine.errors import EngineDeadError, RequestTimeoutError
from tidegate.engine.messages import EngineCoreOutput, EngineCoreOutputs
from tidegate.engine.metrics import PrometheusMetrics
from tidegate.engine.model.config import ModelConfig
from tidegate.engine.tokenizer import Tokenizer


def test_deltas_add_up_to_the_offline_output_and_abort_ends_the_stream(tiny_llama_dir):
    args = dict(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(**args).generate("The tide comes in", greedy)[0].outputs[0]

    async def run():
        metrics = PrometheusMetrics("tiny")
        engine = await AsyncLLM.start(EngineArgs(**args), metrics=metrics)
        try:
            request = engine.input_processor.process("whole", "The tide comes in", greedy)
            deltas = [out async for outs in engine.generate(request) for out in outs]
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            request = engine.input_processor.process("cut", "The tide comes in", long)
            cut = []
            async for outs in engine.generate(request):
                cut.extend(outs)
                if len(cut) >= 3 and not cut[-1].finished:
                    await engine.abort("cut")
            return deltas, cut, metrics.render()[0].decode()
        finally:
            await engine.shutdown()

    deltas, cut, metrics = asyncio.run(run())
    assert [t for d in deltas for t in d.outputs[0].token_ids] == want.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == want.text
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert cut[-1].finished and cut[-1].outputs[0].finish_reason == "abort"
    assert len(cut) < 10
    cut_ids = [t for d in cut for t in d.outputs[0].token_ids]
    assert cut_ids == want.token_ids[: len(cut_ids)]  # the abort repeats nothing
    assert (
        'tidegate:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 1.0'
        in metrics
    )


class _FakeCore:
    """Stands in for an EngineCoreClient: records what AsyncLLM sends it."""

    dead_reason = None
    max_waiting_requests = None

    def __init__(self) -> None:
        self.added = asyncio.Event()
        self.aborted: list[str] = []

    async def add_request(self, request) -> None:
        self.added.set()

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


def _engine(tiny_llama_dir, core: _FakeCore, **kwargs) -> AsyncLLM:
    return AsyncLLM(
        ModelConfig.from_pretrained(tiny_llama_dir),
        Tokenizer(tiny_llama_dir),
        [core],  # type: ignore[list-item]
        max_model_len=256,
        block_size=16,
        router=DataParallelRouter(1, max_hashes_per_core=64),
        **kwargs,
    )


def test_outputs_queued_while_the_consumer_is_away_come_as_one_item(tiny_llama_dir):
    async def run() -> tuple[list, list]:
        core = _FakeCore()
        engine = _engine(tiny_llama_dir, core, metrics=None)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        stream = engine.generate(engine.input_processor.process("r", [10, 11, 12], params))
        first = asyncio.ensure_future(anext(stream))
        await core.added.wait()
        for token in (5, 6, 7):  # three steps, one wake-up
            engine._handle_outputs(EngineCoreOutputs(0, [EngineCoreOutput("r", [token])]))
        caught_up = await first
        engine._handle_outputs(EngineCoreOutputs(0, [EngineCoreOutput("r", [8])]))
        engine._fail_all("the engine core failed")
        before_the_error = await anext(stream)
        with pytest.raises(EngineDeadError):
            await anext(stream)
        return caught_up, before_the_error

    caught_up, before_the_error = asyncio.run(run())
    assert [out.outputs[0].token_ids for out in caught_up] == [[5], [6], [7]]
    assert [out.outputs[0].token_ids for out in before_the_error] == [[8]]


def test_request_timeout_ends_a_waiting_stream_and_aborts_its_request(tiny_llama_dir):
    async def run() -> tuple[list, list[str]]:
        core = _FakeCore()
        engine = _engine(tiny_llama_dir, core, metrics=None, request_timeout=0.2)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        stream = engine.generate(engine.input_processor.process("r", [10, 11, 12], params))
        first = asyncio.ensure_future(anext(stream))
        await core.added.wait()
        engine._handle_outputs(EngineCoreOutputs(0, [EngineCoreOutput("r", [5])]))
        outputs = await first
        with pytest.raises(RequestTimeoutError):
            await anext(stream)
        await asyncio.sleep(0.01)  # the abort goes out in the background
        return outputs, core.aborted

    outputs, aborted = asyncio.run(run())
    assert [out.outputs[0].token_ids for out in outputs] == [[5]]
    assert aborted == ["r"]


def test_a_request_that_finished_before_its_consumer_left_is_counted_once(tiny_llama_dir):
    # A slow client: the engine finishes the request while the consumer still holds an
    # earlier delta, and then the consumer goes away without reading the last one.
    async def run() -> tuple[str, list[str]]:
        core = _FakeCore()
        metrics = PrometheusMetrics("tiny")
        engine = _engine(tiny_llama_dir, core, metrics=metrics)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        stream = engine.generate(engine.input_processor.process("r", [10, 11, 12], params))
        first = asyncio.ensure_future(anext(stream))
        await core.added.wait()
        engine._handle_outputs(EngineCoreOutputs(0, [EngineCoreOutput("r", [5])]))
        assert not (await first)[0].finished
        engine._handle_outputs(EngineCoreOutputs(0, [EngineCoreOutput("r", [6], "length")]))
        await stream.aclose()
        return metrics.render()[0].decode(), core.aborted

    metrics, aborted = asyncio.run(run())
    finished = {
        reason: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tidegate:request_success_total{")
        for reason in ("stop", "length", "abort")
        if f'finished_reason="{reason}"' in line
    }
    assert finished == {"stop": 0, "length": 1, "abort": 0}
    assert aborted == []  # nothing left to abort in the engine


def test_a_pooling_requests_token_counts_as_no_generated_token(tiny_llama_dir):
    """An embedding's or classification's one token only ends it: prompt tokens and the time
    to the vector are counted, generated tokens are not."""

    async def run() -> tuple[str, list]:
        core = _FakeCore()
        metrics = PrometheusMetrics("tiny")
        engine = _engine(tiny_llama_dir, core, metrics=metrics)
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling="last")
        stream = engine.generate(engine.input_processor.process("p", [10, 11, 12], params))
        first = asyncio.ensure_future(anext(stream))
        await core.added.wait()
        out = EngineCoreOutput("p", [0], "length", pooled=[0.5, -0.5])
        engine._handle_outputs(EngineCoreOutputs(0, [out]))
        return metrics.render()[0].decode(), await first

    metrics, outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].pooled == [0.5, -0.5]
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(
            (
                "tidegate:prompt_tokens_total",
                "tidegate:generation_tokens_total",
                "tidegate:time_to_first_token_seconds_count",
                "tidegate:request_generation_tokens_sum",
            )
        )
    }
    assert samples == {
        "tidegate:prompt_tokens_total": 3.0,
        "tidegate:generation_tokens_total": 0.0,
        "tidegate:time_to_first_token_seconds_count": 1.0,
        "tidegate:request_generation_tokens_sum": 0.0,
    }
