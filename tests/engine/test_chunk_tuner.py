"""The adaptive chunk size learns step costs and keeps mixed steps near decode-only ones."""

from __future__ import annotations

import random

from tests.engine.test_scheduler import make_request, make_scheduler, step
from tidegate.engine.core.chunk_tuner import ChunkSizeTuner


def step_seconds(num_decodes: int, num_prefill: int) -> float:
    """A made-up machine: 20 ms per step, 2 ms per decode, 0.1 ms per prompt token."""
    return 0.020 + 0.002 * num_decodes + 0.0001 * num_prefill


def test_before_learning_it_takes_a_small_first_chunk_and_no_cap_without_decodes():
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048)
    assert tuner.threshold(num_decodes=0) == 0
    assert tuner.threshold(num_decodes=8) == 64


def test_learned_chunk_keeps_a_mixed_step_within_one_and_a_half_decode_steps():
    tuner = ChunkSizeTuner(block_size=16, max_tokens=2048, slack=0.5)
    rng = random.Random(0)
    for _ in range(50):
        d = rng.randint(1, 32)
        tuner.observe(d, 0, step_seconds(d, 0) * rng.uniform(0.97, 1.03))
    for _ in range(10):
        tuner.observe(16, 256, step_seconds(16, 256) * rng.uniform(0.97, 1.03))
    chunk = tuner.threshold(16)
    assert chunk % 16 == 0
    # base(16) = 52 ms; half of it buys 260 prompt tokens at 0.1 ms each.
    assert 224 <= chunk <= 288
    assert step_seconds(16, chunk) <= 1.5 * step_seconds(16, 0) * 1.05
    # Fewer decodes make a cheaper step, so the chunk shrinks with them.
    assert tuner.threshold(1) < chunk
    assert tuner.threshold(1000) == 2048


def test_scheduler_with_auto_chunks_a_long_prompt_without_skipping_any_decode():
    scheduler = make_scheduler(max_num_batched_tokens=2048)
    scheduler.limits.adaptive_chunking = True
    scheduler.chunk_tuner = ChunkSizeTuner(scheduler.block_size, 2048)
    decoders = [make_request(f"d{i}", 20, max_tokens=400) for i in range(16)]
    for request in decoders:
        scheduler.add_request(request)
    for _ in range(30):
        out = step(scheduler)
        scheduler.record_step_time(step_seconds(*scheduler._last_mix))
    scheduler.add_request(make_request("long", 3000, max_tokens=2, base=1000))
    chunks = []
    while scheduler.requests["long"].num_output_tokens == 0:
        before = [r.num_output_tokens for r in decoders]
        out = step(scheduler)
        scheduler.record_step_time(step_seconds(*scheduler._last_mix))
        chunks.append(out.num_scheduled_tokens.get("long", 0))
        assert [r.num_output_tokens for r in decoders] == [n + 1 for n in before]
    assert sum(chunks) == 3000
    # After the first (small) chunk taught it the cost, chunks stay near 0.5 * base / cost.
    assert chunks[0] == 64
    assert all(c <= 288 for c in chunks)
    assert max(chunks) >= 192
