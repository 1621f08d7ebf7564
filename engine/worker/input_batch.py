"""The runner's view of its requests, and the flat input tensors of one step built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tidegate.engine.attention.backend import AttentionMetadata
from tidegate.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Token ids, blocks and progress of one request, kept by the runner across steps."""

    req_id: str
    token_ids: np.ndarray  # int64 [max_model_len]; the first num_tokens are valid
    num_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens].tolist()

    def append(self, token_id: int) -> None:
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1
        self.output_token_ids.append(token_id)


@dataclass
class StepInputs:
    """Everything the model and the sampler need for one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled
    sampling_rows: list[int]  # which requests (batch order) those rows belong to


class InputBuilder:
    """Fills preallocated host buffers with vectorized numpy: O(requests) Python per step."""

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

    def build(self, states: list[CachedRequestState], num_scheduled: list[int]) -> StepInputs:
        """Flatten one step's requests into input ids, positions, slots and block tables."""
        num_seqs = len(states)
        num_sched = np.asarray(num_scheduled, dtype=np.int64)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        input_ids = self.input_ids[:num_tokens]
        np.concatenate(
            [
                s.token_ids[c : c + n]
                for s, c, n in zip(states, num_computed, num_sched, strict=True)
            ],
            out=input_ids,
        )
        # Position of each token: its request's first new position plus its offset in the batch.
        positions = self.positions[:num_tokens]
        np.add(
            np.repeat(num_computed - query_start_loc[:-1], num_sched),
            self.arange[:num_tokens],
            out=positions,
        )
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = self.block_table[:num_seqs, :max_blocks]
        for row, state in enumerate(states):
            block_table[row, : len(state.block_ids)] = state.block_ids
        seq_index = np.repeat(np.arange(num_seqs), num_sched)
        slot_mapping = self.slot_mapping[:num_tokens]
        block_of_token = block_table[seq_index, positions // self.block_size]
        np.add(block_of_token * self.block_size, positions % self.block_size, out=slot_mapping)

        seq_lens = num_computed + num_sched
        token_counts = np.fromiter((s.num_tokens for s in states), np.int64, num_seqs)
        sampling_mask = seq_lens >= token_counts
        logits_indices = query_start_loc[1:][sampling_mask] - 1

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
        # On CPU the model reads the host buffers in place (the step is synchronous, so they
        # are free again before the next build); elsewhere a blocking copy keeps that true.
        if self.device.type == "cpu":
            return tensor
        return tensor.to(self.device)
