"""The runner's persistent batch: one row of host arrays per request, kept across steps and
updated in place, and the flat input tensors of one step gathered from those rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tidegate.engine.attention.backend import AttentionMetadata
from tidegate.engine.messages import LoRARequest
from tidegate.engine.sampling_params import SamplingParams

# Rows the batch starts with; it doubles when more requests are held at once (running ones,
# and preempted ones waiting to resume, which keep their tokens).
_INITIAL_ROWS = 16


@dataclass
class CachedRequestState:
    """What the runner keeps of one request besides its row: sampling state and outputs."""

    req_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # A seeded request's generators, one per position a step samples (more than one with
    # speculative decoding), each reseeded for its position before it draws.
    generators: list[torch.Generator] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    # prompt_logprobs: per prompt token from the second on, as the chunks compute them, (ids:
    # the token then the top k, logprobs, rank); sent with the first sampled token, then None.
    prompt_logprobs: tuple[list[list[int]], list[list[float]], list[int]] | None = None
    # pooling: the last prompt token's hidden state ("last"), or the sum of the prompt's
    # hidden states over its first `pooled_upto` positions ("mean"), in float32; sent with the
    # first sampled token, then None.
    pooled: torch.Tensor | None = None
    pooled_upto: int = 0


class PersistentBatch:
    """Token ids, progress and block ids of every request the runner holds, a row each.

    A new request fills a row once; after that a step only appends: its new block ids, the
    tokens it sampled, its computed-token count. Nothing is rebuilt per step, and a step's
    inputs are gathered from the rows with a few vectorized numpy operations.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int) -> None:
        rows = min(max_num_seqs, _INITIAL_ROWS)
        # int32: token and block ids both fit, and the rows take half the memory.
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return len(self.num_tokens)

    def add(self, prompt_token_ids: list[int], block_ids: list[int], num_computed: int) -> int:
        """Give a new request a row; its index."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        n = len(prompt_token_ids)
        self.token_ids[row, :n] = prompt_token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = num_computed
        self.set_blocks(row, block_ids)
        return row

    def remove(self, row: int) -> None:
        """Free a finished request's row for the next new one."""
        self._free_rows.append(row)

    def set_blocks(self, row: int, block_ids: list[int]) -> None:
        """Replace a row's blocks (a new request, or one resumed after preemption)."""
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, tokens: list[int]) -> None:
        """One sampled token for each of these rows."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def append_token_lists(self, rows: list[int], token_lists: list[list[int]]) -> None:
        """Any number of sampled tokens for each of these rows (speculative decoding)."""
        for row, tokens in zip(rows, token_lists, strict=True):
            start = self.num_tokens[row]
            self.token_ids[row, start : start + len(tokens)] = tokens
            self.num_tokens[row] = start + len(tokens)

    def write_guesses(self, row: int, token_ids: list[int]) -> None:
        """Put guessed tokens after a row's known ones, where the step reads its inputs; they
        stay unknown (num_tokens) until sampling confirms them."""
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids

    def set_tokens(self, row: int, token_ids: list[int], end: int) -> None:
        """Write tokens sampled elsewhere (on the last pipeline stage) at positions
        [end - len(token_ids), end): the sampled ones a step reads, which end at its last."""
        self.token_ids[row, end - len(token_ids) : end] = token_ids
        self.num_tokens[row] = max(self.num_tokens[row], end)

    def _grow(self) -> None:
        old = self.num_rows
        new = 2 * old

        def grown(array: np.ndarray) -> np.ndarray:
            bigger = np.zeros((new, *array.shape[1:]), dtype=array.dtype)
            bigger[:old] = array
            return bigger

        self.token_ids = grown(self.token_ids)
        self.num_tokens = grown(self.num_tokens)
        self.num_computed_tokens = grown(self.num_computed_tokens)
        self.block_table = grown(self.block_table)
        self.num_blocks = grown(self.num_blocks)
        self._free_rows.extend(range(new - 1, old - 1, -1))


@dataclass
class StepInputs:
    """Everything the model and the sampler need for one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled
    sampling_rows: list[int]  # which requests (batch order) those rows belong to


class InputBuilder:
    """Gathers one step's flat inputs from the persistent batch into preallocated buffers:
    vectorized numpy, with no Python loop over requests or blocks."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.input_ids = np.zeros(max_num_tokens, dtype=np.int64)
        self.positions = np.zeros(max_num_tokens, dtype=np.int64)
        self.slot_mapping = np.zeros(max_num_tokens, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.arange = np.arange(max_num_tokens, dtype=np.int64)

    def build(
        self,
        batch: PersistentBatch,
        rows: np.ndarray,
        num_scheduled: list[int],
        num_guesses: np.ndarray | None = None,
    ) -> StepInputs:
        """Flatten one step's requests (their rows, in batch order) into input ids, positions,
        slots and block tables. A request with `num_guesses` g > 0 (speculative decoding)
        samples at its last g + 1 positions, the others at their last."""
        num_seqs = len(rows)
        num_sched = np.asarray(num_scheduled, dtype=np.int64)
        num_computed = batch.num_computed_tokens[rows]
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        # Position of each token: its request's first new position plus its offset in the batch.
        seq_index = np.repeat(np.arange(num_seqs), num_sched)
        positions = self.positions[:num_tokens]
        np.add(
            np.repeat(num_computed - query_start_loc[:-1], num_sched),
            self.arange[:num_tokens],
            out=positions,
        )
        input_ids = self.input_ids[:num_tokens]
        input_ids[:] = batch.token_ids[rows[seq_index], positions]
        max_blocks = int(batch.num_blocks[rows].max())
        block_table = self.block_table[:num_seqs, :max_blocks]
        # Columns past a row's own blocks hold older ids of that row: never read.
        np.take(batch.block_table[:, :max_blocks], rows, axis=0, out=block_table)
        slot_mapping = self.slot_mapping[:num_tokens]
        block_of_token = block_table[seq_index, positions // self.block_size]
        np.add(block_of_token * self.block_size, positions % self.block_size, out=slot_mapping)

        seq_lens = num_computed + num_sched
        sampling_mask = seq_lens >= batch.num_tokens[rows]
        logits_indices = query_start_loc[1:][sampling_mask] - 1
        if num_guesses is not None:
            # Each sampling request's last g + 1 positions, in order.
            counts = num_guesses[sampling_mask] + 1
            firsts = logits_indices - counts + 1
            offsets = self.arange[: int(counts.sum())] - np.repeat(
                np.cumsum(counts) - counts, counts
            )
            logits_indices = np.repeat(firsts, counts) + offsets

        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        meta = AttentionMetadata(
            query_start_loc=self._to_device(qsl_cpu),
            seq_lens=self._to_device(seq_lens_cpu),
            block_table=self._to_device(torch.from_numpy(block_table)),
            slot_mapping=self._to_device(torch.from_numpy(slot_mapping)),
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return StepInputs(
            input_ids=self._to_device(torch.from_numpy(input_ids)),
            positions=self._to_device(torch.from_numpy(positions)),
            attn_metadata=meta,
            logits_indices=self._to_device(torch.from_numpy(logits_indices)),
            sampling_rows=np.flatnonzero(sampling_mask).tolist(),
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # On CPU the model reads the host buffers in place (steps run one after the other,
        # so they are free again before the next build); elsewhere a blocking copy keeps
        # that true.
        if self.device.type == "cpu":
            return tensor
        return tensor.to(self.device)
