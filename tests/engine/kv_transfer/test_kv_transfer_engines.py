"""A producer and a consumer EngineCore in this process, moving real KV over ZMQ/TCP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidegate.engine.config import EngineArgs
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.messages import EngineCoreRequest
from tidegate.engine.sampling_params import SamplingParams

BLOCK = 16


def engine_args(model: Path, **overrides) -> EngineArgs:
    values = dict(
        model=str(model),
        dtype="float32",
        num_gpu_blocks=160,
        block_size=BLOCK,
        max_model_len=1536,
        max_num_batched_tokens=512,
        kv_host="127.0.0.1",
        kv_port=0,
    )
    return EngineArgs(**{**values, **overrides})


def drive(
    engine: EngineCore, *requests: EngineCoreRequest, deadline_s: float = 60.0
) -> dict[str, dict]:
    """Run requests to the end; per request id its tokens and kv_transfer_params."""
    for request in requests:
        engine.add_request(request)
    results = {r.request_id: {"tokens": [], "params": None, "finish": None} for r in requests}
    pending = set(results)
    deadline = time.monotonic() + deadline_s
    while pending:
        assert time.monotonic() < deadline, f"requests {pending} did not finish"
        if engine.has_unfinished_requests():
            for out in engine.step():
                result = results[out.req_id]
                result["tokens"] += out.new_token_ids
                result["params"] = out.kv_transfer_params or result["params"]
                if out.finish_reason:
                    result["finish"] = out.finish_reason
                    pending.discard(out.req_id)
        else:
            wait_for_kv_event(engine, deadline)
    return results


def wait_for_kv_event(engine: EngineCore, deadline: float) -> None:
    """Block until a KV event (or a KV timeout) changes something."""
    while not engine.process_kv_events():
        assert time.monotonic() < deadline, "no KV event arrived"
        time.sleep(0.002)


def wait_until(predicate, engine: EngineCore, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        engine.process_kv_events()
        time.sleep(0.005)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def core_request(
    rid: str, prompt: list[int], params: SamplingParams, kv_transfer_params: dict | None = None
) -> EngineCoreRequest:
    """What an API server sends an engine core for this prompt."""
    return EngineCoreRequest(
        rid, prompt, params, [], time.monotonic(), kv_transfer_params=kv_transfer_params
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> Iterator[dict[str, EngineCore]]:
    built = {
        "unified": EngineCore(engine_args(tiny_llama_dir)),
        "producer": EngineCore(engine_args(tiny_llama_dir, kv_role="producer")),
        "consumer": EngineCore(engine_args(tiny_llama_dir, kv_role="consumer")),
    }
    yield built
    for engine in built.values():
        engine.shutdown()


def prefill_remotely(producer: EngineCore, rid: str, prompt: list[int]) -> dict:
    """The producer leg: compute the prompt, return the params naming its pinned blocks."""
    request = core_request(rid, prompt, greedy(1), {"do_remote_decode": True})
    params = drive(producer, request)[rid]["params"]
    assert params is not None and params["do_remote_prefill"]
    return params


def decode_with(consumer: EngineCore, rid: str, prompt: list[int], params: dict, n: int = 24):
    request = core_request(rid, prompt, greedy(n), params)
    return drive(consumer, request)[rid]["tokens"]


def all_free(*engines: EngineCore) -> bool:
    return all(e.stats()["num_free_blocks"] == e.stats()["num_total_blocks"] for e in engines)


def make_prompt(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 900 + 3 for i in range(length)]


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 250, 1030])
def test_consumer_output_equals_unified(engines: dict[str, EngineCore], length: int) -> None:
    prompt = make_prompt(length, offset=length)
    expected = drive(engines["unified"], core_request(f"u{length}", prompt, greedy(24)))
    params = prefill_remotely(engines["producer"], f"p{length}", prompt)
    before = engines["consumer"].stats()
    got = decode_with(engines["consumer"], f"c{length}", prompt, params)
    assert got == expected[f"u{length}"]["tokens"]
    after = engines["consumer"].stats()
    assert after["kv_transfer_fallbacks"] == before["kv_transfer_fallbacks"]
    # The consumer computes only the last prompt token; everything else came over the wire.
    assert after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"] == 1
    if length > 1:
        assert after["kv_received_bytes"] > before["kv_received_bytes"]
    # The consumer's notice frees the producer's pin.
    wait_until(lambda: engines["producer"].stats()["kv_pinned_blocks"] == 0, engines["producer"])
    assert all_free(engines["producer"], engines["consumer"])
    for engine in engines.values():
        engine.kv_cache_manager.check_invariants()


def test_async_producer_and_consumer_give_the_unified_tokens(
    engines: dict[str, EngineCore], tiny_llama_dir: Path
) -> None:
    """Both sides plan each step while the last runs: the producer's pin is in place before
    the output naming it leaves, and the consumer's first step reads the pulled KV."""
    pair = {
        role: EngineCore(engine_args(tiny_llama_dir, kv_role=role, async_scheduling=True))
        for role in ("producer", "consumer")
    }
    try:
        for length in (1, 17, 250):
            prompt = make_prompt(length, offset=3 * length)
            expected = drive(engines["unified"], core_request(f"ua{length}", prompt, greedy(30)))
            params = prefill_remotely(pair["producer"], f"pa{length}", prompt)
            got = decode_with(pair["consumer"], f"ca{length}", prompt, params, n=30)
            assert got == expected[f"ua{length}"]["tokens"]
        assert pair["consumer"].stats()["kv_transfer_fallbacks"] == 0
        wait_until(lambda: pair["producer"].stats()["kv_pinned_blocks"] == 0, pair["producer"])
        assert all_free(*pair.values())
    finally:
        for engine in pair.values():
            engine.shutdown()


def test_a_speculating_consumer_gives_the_unified_tokens(
    engines: dict[str, EngineCore], tiny_llama_dir: Path
) -> None:
    """A decode pool with prompt lookup: its first step reads the pulled KV, and the guesses
    it takes back never touch it."""
    consumer = EngineCore(
        engine_args(
            tiny_llama_dir,
            kv_role="consumer",
            speculative_config={"num_speculative_tokens": 4},
        )
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, allowed_token_ids=[5, 6, 7])
    try:
        for length in (17, 250):
            prompt = make_prompt(length, offset=5 * length)
            rid = f"s{length}"
            expected = drive(engines["unified"], core_request(f"u{rid}", prompt, params))
            pulled = prefill_remotely(engines["producer"], f"p{rid}", prompt)
            got = drive(consumer, core_request(f"c{rid}", prompt, params, pulled))
            assert got[f"c{rid}"]["tokens"] == expected[f"u{rid}"]["tokens"]
        stats = consumer.stats()
        assert stats["kv_transfer_fallbacks"] == 0 and stats["kv_received_bytes"] > 0
        assert stats["spec_decode_num_accepted_tokens"] > 0
        producer = engines["producer"]
        wait_until(lambda: producer.stats()["kv_pinned_blocks"] == 0, producer)
        assert all_free(engines["producer"], consumer)
    finally:
        consumer.shutdown()


def test_consumer_prefix_hits_are_not_pulled_again(engines: dict[str, EngineCore]) -> None:
    consumer = engines["consumer"]
    shared = make_prompt(96, offset=500)
    first, second = [*shared, 11, 12, 13], [*shared, 21, 22, 23, 24]
    decode_with(consumer, "c-first", first, prefill_remotely(engines["producer"], "p1", first))
    received = consumer.stats()["kv_received_bytes"]
    decode_with(consumer, "c-second", second, prefill_remotely(engines["producer"], "p2", second))
    pulled = consumer.stats()["kv_received_bytes"] - received
    bytes_per_block = consumer.executor.worker.runner.kv_cache_bytes_per_block()
    # 96 shared tokens = 6 cached blocks; only the 7th (partial) block moves.
    assert pulled == bytes_per_block
    expected = drive(engines["unified"], core_request("u-second", second, greedy(24)))
    params = prefill_remotely(engines["producer"], "p3", second)
    assert decode_with(consumer, "c-third", second, params) == expected["u-second"]["tokens"]
    wait_until(lambda: all_free(engines["producer"]), engines["producer"])


def test_failed_pull_falls_back_to_computing_the_prompt(engines: dict[str, EngineCore]) -> None:
    consumer = engines["consumer"]
    prompt = make_prompt(70, offset=3)
    expected = drive(engines["unified"], core_request("u-fb", prompt, greedy(16)))["u-fb"]["tokens"]
    params = prefill_remotely(engines["producer"], "p-fb", prompt)
    # The producer no longer serves this transfer (as after its timeout).
    engines["producer"].abort_requests(["p-fb"])
    wait_until(lambda: all_free(engines["producer"]), engines["producer"])
    before = consumer.stats()
    assert decode_with(consumer, "c-fb", prompt, params, n=16) == expected
    after = consumer.stats()
    assert after["kv_transfer_fallbacks"] == before["kv_transfer_fallbacks"] + 1
    assert after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"] == 70
    assert all_free(consumer)
    consumer.kv_cache_manager.check_invariants()


def test_a_different_prompt_is_never_read_from_the_producer(
    engines: dict[str, EngineCore],
) -> None:
    consumer = engines["consumer"]
    prompt = make_prompt(40, offset=9)
    params = prefill_remotely(engines["producer"], "p-other", prompt)
    other = [*prompt[:-1], prompt[-1] + 1]  # same length, last token differs
    expected = drive(engines["unified"], core_request("u-other", other, greedy(12)))
    before = consumer.stats()
    assert decode_with(consumer, "c-other", other, params, n=12) == expected["u-other"]["tokens"]
    after = consumer.stats()
    assert after["kv_transfer_fallbacks"] == before["kv_transfer_fallbacks"] + 1
    assert after["kv_received_bytes"] == before["kv_received_bytes"]
    # The producer is released even though nothing was read.
    wait_until(lambda: all_free(engines["producer"]), engines["producer"])


def test_abort_while_pulling_frees_both_sides(engines: dict[str, EngineCore]) -> None:
    consumer = engines["consumer"]
    prompt = make_prompt(300, offset=17)
    params = prefill_remotely(engines["producer"], "p-ab", prompt)
    consumer.add_request(core_request("c-ab", prompt, greedy(8), params))
    consumer.step()  # parks it and starts the pull
    assert consumer.stats()["num_pulling"] == 1
    consumer.abort_requests(["c-ab"])
    assert consumer.stats()["num_pulling"] == 0
    assert all_free(consumer)
    consumer.step()  # the workers drop the pull's result, whenever it arrives
    wait_until(lambda: all_free(engines["producer"]), engines["producer"])
    # A later request is untouched by the dropped pull.
    expected = drive(engines["unified"], core_request("u-after", prompt, greedy(8)))
    params = prefill_remotely(engines["producer"], "p-after", prompt)
    assert decode_with(consumer, "c-after", prompt, params, n=8) == expected["u-after"]["tokens"]
    consumer.kv_cache_manager.check_invariants()


def test_unclaimed_pins_expire_after_the_timeout(tiny_llama_dir: Path) -> None:
    producer = EngineCore(engine_args(tiny_llama_dir, kv_role="producer", kv_transfer_timeout=0.5))
    try:
        prefill_remotely(producer, "p-exp", make_prompt(50))
        assert producer.stats()["kv_pinned_blocks"] == 4
        started = time.monotonic()
        wait_until(lambda: producer.stats()["kv_pinned_blocks"] == 0, producer, timeout_s=5.0)
        assert time.monotonic() - started >= 0.3
        assert producer.stats()["kv_pins_expired"] == 1
        assert all_free(producer)
        producer.kv_cache_manager.check_invariants()
    finally:
        producer.shutdown()


def test_a_dead_producer_is_noticed_at_once_and_the_prompt_computed_here(
    tiny_llama_dir: Path,
) -> None:
    consumer = EngineCore(engine_args(tiny_llama_dir, kv_role="consumer", kv_transfer_timeout=30))
    producer = EngineCore(engine_args(tiny_llama_dir, kv_role="producer"))
    unified = EngineCore(engine_args(tiny_llama_dir))
    try:
        prompt = make_prompt(45, offset=1)
        params = prefill_remotely(producer, "p-dead", prompt)
        producer.shutdown()  # nobody listens on its ports any more
        expected = drive(unified, core_request("u-dead", prompt, greedy(10)))["u-dead"]["tokens"]
        started = time.monotonic()
        assert decode_with(consumer, "c-dead", prompt, params, n=10) == expected
        # The refused connection fails the pull; nobody waits for the 30 s timeout.
        assert time.monotonic() - started < 10.0
        assert consumer.stats()["kv_transfer_fallbacks"] == 1
        assert all_free(consumer)
    finally:
        consumer.shutdown()
        unified.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(2, 1), (1, 2)])
def test_transfer_between_different_tensor_parallel_sizes(
    tiny_llama_dir: Path, producer_tp: int, consumer_tp: int
) -> None:
    """Each consumer rank reads its KV heads from whichever producer rank holds them."""
    unified = EngineCore(engine_args(tiny_llama_dir))
    producer = EngineCore(
        engine_args(tiny_llama_dir, kv_role="producer", tensor_parallel_size=producer_tp)
    )
    consumer = EngineCore(
        engine_args(tiny_llama_dir, kv_role="consumer", tensor_parallel_size=consumer_tp)
    )
    try:
        for length in (17, 130):
            prompt = make_prompt(length, offset=5)
            expected = drive(unified, core_request(f"u{length}", prompt, greedy(12)))
            params = prefill_remotely(producer, f"p{length}", prompt)
            assert len(params["remote_data_ports"]) == producer_tp
            got = decode_with(consumer, f"c{length}", prompt, params, n=12)
            assert got == expected[f"u{length}"]["tokens"]
        assert consumer.stats()["kv_transfer_fallbacks"] == 0
        wait_until(lambda: all_free(producer, consumer), producer)
    finally:
        for engine in (unified, producer, consumer):
            engine.shutdown()
