"""The real engine (tiny model) under a prefill stall scenario, and continuous batching."""

from __future__ import annotations

import random
import time

from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.messages import EngineCoreRequest
from tidegate.engine.sampling_params import SamplingParams


def make_request(req_id: str, n: int, max_tokens: int, seed: int) -> EngineCoreRequest:
    rng = random.Random(seed)
    prompt = [rng.randrange(6, 900) for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params, [2], arrival_time=time.monotonic())


def test_running_decodes_get_a_token_every_step_while_a_2000_token_prompt_prefills(
    tiny_llama_dir,
):
    budget = 256
    core = EngineCore(
        EngineArgs(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_num_batched_tokens=budget,
            max_model_len=4096,
            num_gpu_blocks=600,
        )
    )
    for i in range(6):
        core.add_request(make_request(f"d{i}", 20 + 3 * i, max_tokens=400, seed=i))
    decoders = [core.scheduler.requests[f"d{i}"] for i in range(6)]
    core.step()
    assert all(r.num_output_tokens == 1 for r in decoders)

    core.add_request(make_request("long", 2000, max_tokens=3, seed=99))
    long_request = core.scheduler.requests["long"]
    chunks = []
    while long_request.num_output_tokens == 0:
        produced = {r.request_id: r.num_output_tokens for r in decoders}
        core.step()
        plan = core.last_scheduler_output
        assert plan.total_num_scheduled_tokens <= budget
        for request in decoders:
            assert plan.num_scheduled_tokens[request.request_id] == 1
            assert request.num_output_tokens == produced[request.request_id] + 1
        chunks.append(plan.num_scheduled_tokens.get("long", 0))
    assert sum(chunks) == 2000
    assert len(chunks) == -(-2000 // (budget - len(decoders)))
    while core.has_unfinished_requests():
        core.step()
    stats = core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
