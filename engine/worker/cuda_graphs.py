"""CUDA graphs of decode-only steps (compilation level 2).

A decode step launches the same kernels every time for a given batch size; only the data they
read differ. Launching them one by one costs the CPU several microseconds each, hundreds per
step, which at small batches is longer than the GPU takes to run them. So each batch size in
`capture_sizes` is captured once at start-up into a CUDA graph that reads its inputs from
static buffers; a decode step copies its inputs into those buffers, pads the batch up to the
next captured size and replays the graph: one launch instead of hundreds.

What a captured graph fixes, and how the step respects it:

- Tensor addresses. Every input lives in a static buffer owned by `DecodeGraphs`; the
  output is the tensor the graph wrote when it was captured, overwritten by every replay.
- Host-side values. The attention metadata a graph was captured with keeps its host ints
  (num_seqs, max_seq_len, ...) for ever, so only backends that read nothing but device
  tensors during a step can be captured (`cuda_graph_safe`: Triton yes, torch no). Its
  max_seq_len is the model's context, so launch choices made from it (split-KV) stay valid
  for any sequence.
- The batch size. A batch of n decodes runs in the graph of the smallest captured size >= n;
  the padding rows read one key of block 0 and write no KV (slot -1), so they touch nothing
  a real sequence owns, and their outputs are dropped.

Graphs share one memory pool, captured largest first so the smaller ones reuse its memory.
Prefill chunks, mixed steps and batches above the largest size run as they would without
graphs (compiled, level 1).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from tidegate.engine.attention.backend import AttentionMetadata
from tidegate.engine.worker.compilation import is_decode_only, padded_size
from tidegate.engine.worker.input_batch import StepInputs

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Graph(Protocol):
    """Something that records `fn` once and replays it into the same output tensor."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """One torch.cuda.CUDAGraph, allocating from a pool shared with its siblings."""

    def __init__(self, pool: tuple[int, int]) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class CallAgain:
    """A graph stand-in for machines without CUDA: a replay calls the function again on the
    same static buffers and metadata, and copies its result into the captured output.

    It shares what a CUDA graph fixes (buffers, the metadata object and its host ints, the
    padded batch), so it tests everything here but the capture itself.
    """

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn, self._out = fn, fn()
        return self._out

    def replay(self) -> None:
        assert self._fn is not None and self._out is not None, "replay before capture"
        self._out.copy_(self._fn())


def cuda_graph_factory(device: torch.device) -> Callable[[], Graph]:
    """New CUDA graphs on `device`, all allocating from one pool."""
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


class DecodeGraphs:
    """One captured graph per batch size for decode-only steps, and the buffers they read."""

    def __init__(
        self,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        new_graph: Callable[[], Graph],
    ) -> None:
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be increasing and positive, got {sizes}")
        self.sizes = sizes
        self.max_seq_len = max_seq_len
        self.device = device
        self.new_graph = new_graph
        largest = sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        # One token per sequence: the same query_start_loc for every step of a size.
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            (largest, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter[int] = Counter()  # replays per captured size

    def metadata(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` decodes is captured with (and so replays with)."""
        qsl_cpu = torch.arange(size + 1, dtype=torch.int32)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            num_seqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=qsl_cpu,
            # Not per step: a graph-safe backend never reads the host copies.
            seq_lens_cpu=torch.full((size,), self.max_seq_len, dtype=torch.int32),
        )

    def capture(self, forward: Forward) -> float:
        """Capture every size, largest first; returns the seconds it took."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            step = partial(
                forward, self.input_ids[:size], self.positions[:size], self.metadata(size)
            )
            # Run once outside the capture: kernels compile (Triton, inductor) on first use,
            # and a capture may only record launches, not load modules.
            step()
            graph = self.new_graph()
            self.outputs[size] = graph.capture(step)
            self.graphs[size] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def size_for(self, num_scheduled_tokens: list[int]) -> int | None:
        """The captured size a step runs at, or None when it must run without a graph."""
        if not self.graphs or not is_decode_only(num_scheduled_tokens):
            return None
        return padded_size(len(num_scheduled_tokens), self.sizes)

    def run(self, step: StepInputs, size: int) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n <= size sequences."""
        meta = step.attn_metadata
        n = meta.num_seqs
        if meta.num_tokens != n or n > size:
            raise ValueError(
                f"a graph of {size} decodes cannot run {n} sequences of {meta.num_tokens} tokens"
            )
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past this step's widest row keep older ids: valid blocks, never read.
        self.block_table[:n, : meta.block_table.shape[1]].copy_(meta.block_table)
        if size > n:
            # Padding: token 0 at position 0, attending to one key of block 0, writing none.
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_table[n:size, 0].zero_()
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.outputs[size][:n]
