"""AsyncLLM against a real engine core process: deltas add up, aborts end streams."""

from __future__ import annotations

import asyncio

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.async_llm import AsyncLLM
from tidegate.engine.config import EngineArgs
from tidegate.engine.metrics import PrometheusMetrics


def test_deltas_add_up_to_the_offline_output_and_abort_ends_the_stream(tiny_llama_dir):
    args = dict(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(**args).generate("The tide comes in", greedy)[0].outputs[0]

    async def run():
        metrics = PrometheusMetrics("tiny")
        engine = await AsyncLLM.start(EngineArgs(**args), metrics=metrics)
        try:
            request = engine.input_processor.process("whole", "The tide comes in", greedy)
            deltas = [out async for out in engine.generate(request)]
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            request = engine.input_processor.process("cut", "The tide comes in", long)
            cut = []
            async for out in engine.generate(request):
                cut.append(out)
                if len(cut) == 3:
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
