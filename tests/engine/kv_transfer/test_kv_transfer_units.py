"""The pure parts of KV transfer: params, head routing across TP sizes, pins and pulls."""

from __future__ import annotations

import pytest

from tidegate.engine.kv_transfer.heads import HeadSource, head_sources, heads_of_rank
from tidegate.engine.kv_transfer.params import (
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
    prompt_digest,
)
from tidegate.engine.kv_transfer.tracker import Pin, PinTable, PullTracker

PREFILL = {
    "do_remote_prefill": True,
    "remote_engine_id": "p-1",
    "remote_request_id": "r~0",
    "remote_host": "10.0.0.7",
    "remote_port": 14579,
    "remote_data_ports": [14580],
    "remote_block_ids": [3, 4],
    "remote_block_size": 16,
    "remote_tp_size": 1,
    "prompt_digest": "abc",
}


def test_params_parse_by_direction() -> None:
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert isinstance(parse_kv_transfer_params({"do_remote_decode": True}), RemoteDecode)
    params = parse_kv_transfer_params({**PREFILL, "extra": 1})
    assert isinstance(params, RemotePrefill)
    assert params.remote_block_ids == [3, 4]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"foo": 1}, "must set do_remote_decode"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "exclude each other"),
        ({**PREFILL, "remote_port": 0}, "remote_port"),
        ({**PREFILL, "remote_data_ports": []}, "remote_data_ports"),
        ({k: v for k, v in PREFILL.items() if k != "remote_host"}, "remote_host"),
        ({**PREFILL, "remote_block_ids": "x"}, "remote_block_ids"),
    ],
)
def test_bad_params_say_what_is_wrong(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_params(raw)


def test_prompt_digest_tells_prompts_apart() -> None:
    assert prompt_digest([1, 2, 3]) == prompt_digest([1, 2, 3])
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])


def test_heads_of_rank_split_and_replicate() -> None:
    assert [heads_of_rank(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # 2 heads over 4 ranks: each head kept by two ranks.
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError):
        heads_of_rank(6, 4, 0)


@pytest.mark.parametrize(
    ("heads", "producer_tp", "consumer_tp"),
    [
        (8, 1, 1),
        (8, 2, 2),
        (8, 1, 4),
        (8, 4, 1),
        (8, 2, 4),
        (8, 4, 2),
        (2, 4, 1),
        (2, 1, 4),
        (2, 4, 4),
    ],
)
def test_every_consumer_head_comes_from_a_producer_rank_holding_it(
    heads: int, producer_tp: int, consumer_tp: int
) -> None:
    for rank in range(consumer_tp):
        first, count = heads_of_rank(heads, consumer_tp, rank)
        covered = []
        for source in head_sources(heads, producer_tp, consumer_tp, rank):
            p_first, p_count = heads_of_rank(heads, producer_tp, source.rank)
            assert 0 <= source.src_start < source.src_end <= p_count
            covered += [p_first + h for h in range(source.src_start, source.src_end)]
            assert source.dst_start == covered.index(p_first + source.src_start)
        assert covered == list(range(first, first + count))


def test_same_tp_reads_one_rank_whole() -> None:
    assert head_sources(8, 2, 2, 1) == [HeadSource(rank=1, src_start=0, src_end=4, dst_start=0)]


def test_pin_table_expires_in_deadline_order() -> None:
    pins = PinTable()
    pins.add(Pin("a", "ra", 3, deadline=10.0))
    pins.add(Pin("b", "rb", 2, deadline=20.0))
    assert pins.num_blocks == 5
    assert pins.expired(15.0) == ["a"]
    assert pins.next_deadline() == 10.0
    assert pins.pop("a") is not None
    assert pins.pop("a") is None  # a second notice is harmless
    assert pins.num_blocks == 2
    with pytest.raises(ValueError):
        pins.add(Pin("b", "rb", 1, deadline=30.0))


def test_pull_completes_when_every_rank_reported() -> None:
    pulls = PullTracker(world_size=2)
    pulls.start("r", deadline=5.0)
    assert pulls.report("r", 0, True, 100, 0.5) == "pending"
    assert pulls.report("r", 1, True, 100, 0.7) == "done"
    assert pulls.finish("r") == (200, 0.7)
    assert "r" not in pulls


def test_pull_fails_at_the_first_failed_rank_and_ignores_late_reports() -> None:
    pulls = PullTracker(world_size=2)
    pulls.start("r", deadline=5.0)
    assert pulls.report("r", 1, False, 0, 0.1) == "failed"
    assert pulls.report("r", 0, True, 100, 0.2) is None
    pulls.start("s", deadline=1.0)
    assert pulls.pop_expired(2.0) == ["s"]
    assert pulls.next_deadline() is None


def test_the_offline_llm_refuses_a_kv_role(tiny_llama_dir) -> None:
    from tidegate.engine import LLM

    with pytest.raises(ValueError, match="tidegate router"):
        LLM(str(tiny_llama_dir), kv_role="consumer")
