"""Level 2's decode graphs on CPU: static buffers, padding and replay, without the capture.

`CallAgain` stands in for a CUDA graph: it keeps what a capture fixes (the buffers, the
metadata object with its host ints, the padded batch) and replays by calling again. The
Triton backend (interpreted, as in test_triton_engine.py) is the one level 2 captures.
"""

from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.attention.backend import AttentionMetadata
from tidegate.engine.worker.cuda_graphs import CallAgain, DecodeGraphs
from tidegate.engine.worker.input_batch import StepInputs

BLOCK_SIZE = 4
NUM_SLOTS = 64 * BLOCK_SIZE


def decode_step(seqs: list[tuple[int, int, list[int]]]) -> StepInputs:
    """One decode-only step: per sequence (token id, its position, its block ids)."""
    n = len(seqs)
    width = max(len(blocks) for _, _, blocks in seqs)
    table = torch.full((n, width), -1, dtype=torch.int32)
    for row, (_, _, blocks) in enumerate(seqs):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    positions = torch.tensor([pos for _, pos, _ in seqs])
    slots = torch.tensor(
        [blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for _, pos, blocks in seqs]
    )
    seq_lens = (positions + 1).to(torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slots,
        num_seqs=n,
        num_tokens=n,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return StepInputs(
        input_ids=torch.tensor([tok for tok, _, _ in seqs]),
        positions=positions,
        attn_metadata=meta,
        logits_indices=torch.arange(n),
        sampling_rows=list(range(n)),
    )


class RecordingForward:
    """A model that writes each token id to its KV slot and echoes what it was given."""

    def __init__(self) -> None:
        self.cache = torch.zeros(NUM_SLOTS, dtype=torch.int64)
        self.host_ints: list[tuple[int, int]] = []

    def __call__(self, ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        self.host_ints.append((meta.num_seqs, meta.max_seq_len))
        written = meta.slot_mapping >= 0
        self.cache[meta.slot_mapping[written]] = ids[written]
        first_block = meta.block_table[:, 0].long()
        columns = [ids, positions, meta.seq_lens.long(), first_block, meta.slot_mapping]
        return torch.stack(columns, dim=1)


@pytest.fixture
def graphs() -> tuple[DecodeGraphs, RecordingForward]:
    forward = RecordingForward()
    graphs = DecodeGraphs(
        sizes=[1, 2, 4, 8],
        max_blocks_per_seq=16,
        max_seq_len=64,
        device=torch.device("cpu"),
        new_graph=CallAgain,
    )
    graphs.capture(forward)
    return graphs, forward


def test_capture_records_each_size_once_largest_first_with_fixed_host_ints(graphs):
    graphs, forward = graphs
    # One run to compile kernels, one captured: largest first so smaller reuse its memory.
    assert forward.host_ints == [(size, 64) for size in (8, 8, 4, 4, 2, 2, 1, 1)]
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    assert not forward.cache.any()  # capture wrote no KV: every slot was -1


def test_a_batch_runs_padded_and_only_its_own_slots_are_written(graphs):
    graphs, forward = graphs
    forward.host_ints.clear()
    wide = [(100 + i, 9 + i, [10 + i, 20 + i, 30 + i, 40 + i, 50 + i]) for i in range(7)]
    out = graphs.run(decode_step(wide), graphs.size_for([1] * 7))
    assert graphs.replays == {8: 1}
    assert forward.host_ints == [(8, 64)]  # the captured metadata, not this step's
    assert out.shape[0] == 7
    for row, (token, pos, blocks) in enumerate(wide):
        slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        assert out[row].tolist() == [token, pos, pos + 1, blocks[0], slot]
        assert forward.cache[slot] == token
    assert int(forward.cache.count_nonzero()) == 7  # the padding row wrote nothing

    # A smaller batch after a wider one: stale rows and columns must not leak in.
    narrow = [(7, 2, [3]), (8, 0, [5]), (9, 5, [6, 11])]
    before = forward.cache.clone()
    out = graphs.run(decode_step(narrow), graphs.size_for([1] * 3))
    assert graphs.replays == {8: 1, 4: 1}
    assert out.tolist() == [[7, 2, 3, 3, 14], [8, 0, 1, 5, 20], [9, 5, 6, 6, 45]]
    changed = (forward.cache != before).nonzero().flatten().tolist()
    assert changed == [14, 20, 45]
    # The padding row: token 0 at position 0, one key of block 0, no KV slot.
    assert graphs.seq_lens[3] == 1 and graphs.slot_mapping[3] == -1
    assert graphs.block_table[3, 0] == 0 and graphs.input_ids[3] == 0


def test_steps_that_are_not_small_decodes_run_without_a_graph(graphs):
    graphs, _ = graphs
    assert graphs.size_for([1, 1, 1]) == 4
    assert graphs.size_for([1, 5, 1]) is None  # a prefill chunk
    assert graphs.size_for([1] * 9) is None  # above the largest captured size
    assert graphs.size_for([]) is None
    with pytest.raises(ValueError, match="a graph of 2 decodes cannot run 3 sequences"):
        graphs.run(decode_step([(1, 0, [1]), (2, 0, [2]), (3, 0, [3])]), 2)


def test_capture_sizes_must_increase():
    with pytest.raises(ValueError, match="capture sizes must be increasing"):
        DecodeGraphs([4, 2], 4, 64, torch.device("cpu"), CallAgain)


@pytest.mark.slow
@pytest.mark.parametrize("level", [0, 1], ids=["eager", "compiled"])
def test_engine_with_decode_graphs_gives_eager_tokens(tiny_llama_dir, level):
    """The whole engine replays graphs for its decode steps and matches the torch backend.

    Compiled, it is level 2's composition on CPU (inductor's model around the Triton
    attention op, replayed from static buffers), all but the capture itself.
    """
    pytest.importorskip("triton", reason="the triton package is not installed")
    common = dict(
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks=96,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        enable_prefix_caching=True,
    )
    reference = LLM(model=str(tiny_llama_dir), attention_backend="torch", **common)
    llm = LLM(
        model=str(tiny_llama_dir),
        attention_backend="triton",
        compilation_level=level,
        **common,
    )
    runner = llm.engine.executor.worker.runner
    assert runner.compilation_level == level
    runner.capture_decode_graphs(CallAgain)
    assert runner.decode_graphs.sizes == [1, 2, 4, 8]
    shared = list(range(11, 43))  # two full blocks
    # Seven requests finishing at different lengths: decode batches shrink 7 -> 1, each
    # padded to 8, 4, 2 or 1 after wider batches left their rows behind. The first round's
    # prompt is chunked and caches the shared prefix, which the second round hits.
    rounds = [
        ([[*shared, *range(50, 90)]], [SamplingParams(temperature=0, max_tokens=4)]),
        (
            [[*shared, *range(100 + 7 * i, 101 + 8 * i)] for i in range(7)],
            [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(7)],
        ),
    ]
    for prompts, params in rounds:
        want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
    replays = runner.decode_graphs.replays
    assert {8, 4, 2, 1} <= set(replays)
    stats = llm.stats()
    assert sum(replays.values()) < stats["num_steps"]  # prefill steps ran without a graph
    assert stats["prefix_cache_hits"] >= 7 * len(shared)


@pytest.mark.slow
def test_lora_in_decode_graphs_reads_its_adapters_from_static_buffers(tiny_llama_dir, tmp_path):
    """With the triton backend the LoRA delta is Triton kernels launched by shape, reading
    which rows use which slot from static buffers: replayed graphs give each request of a
    mix of adapters the tokens the torch path gives (the interpreter stands in for a GPU)."""
    pytest.importorskip("triton", reason="the triton package is not installed")
    from tidegate.engine.lora.tiny_adapter import make_tiny_adapter

    adapters = [
        make_tiny_adapter(tiny_llama_dir, tmp_path / f"a{i}", rank=4 * (i + 1), seed=i)
        for i in range(2)
    ]
    common = dict(
        dtype="float32",
        max_num_seqs=4,
        max_model_len=128,
        num_gpu_blocks=64,
        enable_lora=True,
        max_loras=2,
    )
    prompts = [[1, *range(20 + 9 * i, 30 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for backend in ("torch", "triton"):
        with LLM(model=str(tiny_llama_dir), attention_backend=backend, **common) as llm:
            if backend == "triton":
                llm.engine.executor.worker.runner.capture_decode_graphs(CallAgain)
            loras = [llm.load_lora(f"a{i}", str(path)) for i, path in enumerate(adapters)]
            mix = [loras[0], None, loras[1], loras[0]]
            result = llm.generate(prompts, params, lora_request=mix)
            outputs.append([o.outputs[0].token_ids for o in result])
            if backend == "triton":
                replays = llm.engine.executor.worker.runner.decode_graphs.replays
                assert sum(replays.values()) > 0
    assert outputs[1] == outputs[0]


class OneReplayAtATime(CallAgain):
    """A stand-in whose replay takes a while and says when it runs, so that a write to the
    graphs' static buffers during a replay, from any thread, is caught."""

    running = threading.Event()

    def replay(self) -> None:
        self.running.set()
        try:
            time.sleep(0.002)  # a GPU still reading the buffers
            super().replay()
        finally:
            self.running.clear()


@pytest.mark.slow
def test_async_scheduling_never_writes_graph_buffers_while_a_replay_runs(
    tiny_llama_dir, monkeypatch
):
    """Steps N and N+1 in flight, graphs replayed: the next step's inputs are copied into the
    static buffers only after the replay before it is done, and the tokens are eager's."""
    pytest.importorskip("triton", reason="the triton package is not installed")
    writes = []
    original_run = DecodeGraphs.run

    def guarded_run(self, step, size):
        assert not OneReplayAtATime.running.is_set(), "buffers written during a replay"
        writes.append(threading.get_ident())
        return original_run(self, step, size)

    monkeypatch.setattr(DecodeGraphs, "run", guarded_run)
    common = dict(dtype="float32", max_num_seqs=4, max_model_len=128, num_gpu_blocks=64)
    reference = LLM(model=str(tiny_llama_dir), attention_backend="torch", **common)
    llm = LLM(
        model=str(tiny_llama_dir), attention_backend="triton", async_scheduling=True, **common
    )
    executor = llm.engine.executor
    runner = executor.worker.runner
    # Captured where the worker runs its steps, as Worker.initialize_kv_cache does.
    executor._call(runner.capture_decode_graphs, OneReplayAtATime)
    prompts = [[*range(11, 20 + 5 * i)] for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 4 * i, ignore_eos=True) for i in range(4)
    ]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert sum(runner.decode_graphs.replays.values()) >= 15
    assert len(set(writes)) == 1 and writes[0] != threading.get_ident()  # the worker's thread
