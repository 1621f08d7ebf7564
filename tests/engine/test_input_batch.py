"""The persistent batch and the step inputs gathered from it, against plain per-request lists."""

from __future__ import annotations

import random

import numpy as np
import torch

from tidegate.engine.worker.input_batch import InputBuilder, PersistentBatch

BLOCK = 4
MAX_LEN = 64
MAX_BLOCKS = MAX_LEN // BLOCK


class Plain:
    """One request as lists: what the rows must hold."""

    def __init__(self, tokens: list[int], blocks: list[int], computed: int) -> None:
        self.tokens, self.blocks, self.computed = tokens, blocks, computed


def expected_inputs(plains: list[Plain], num_sched: list[int]) -> dict:
    ids, positions, slots, sampled = [], [], [], []
    for i, (p, n) in enumerate(zip(plains, num_sched, strict=True)):
        for pos in range(p.computed, p.computed + n):
            ids.append(p.tokens[pos])
            positions.append(pos)
            slots.append(p.blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        if p.computed + n >= len(p.tokens):
            sampled.append(i)
    return {"ids": ids, "positions": positions, "slots": slots, "sampled": sampled}


def test_steps_gathered_from_rows_equal_the_plain_lists_through_growth_reuse_and_preemption():
    rng = random.Random(5)
    batch = PersistentBatch(max_num_seqs=64, max_model_len=MAX_LEN, max_blocks_per_seq=MAX_BLOCKS)
    builder = InputBuilder(256, 64, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    assert batch.num_rows == 16
    live: dict[int, Plain] = {}  # row -> request
    next_block = 0

    def blocks_for(num_tokens: int, have: int = 0) -> list[int]:
        nonlocal next_block
        needed = -(-num_tokens // BLOCK) - have
        fresh = list(range(next_block, next_block + max(needed, 0)))
        next_block += len(fresh)
        return fresh

    for _ in range(300):
        # Arrivals (up to 40 at once: the rows double twice), finishes, preemptions.
        for _ in range(rng.randrange(0, 4) if len(live) < 40 else 0):
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 30))]
            computed = rng.randrange(0, len(prompt)) // BLOCK * BLOCK  # a prefix hit
            blocks = blocks_for(len(prompt))
            row = batch.add(prompt, blocks, computed)
            assert row not in live
            live[row] = Plain(list(prompt), blocks, computed)
        for row in [r for r in live if rng.random() < 0.05]:
            batch.remove(row)
            del live[row]
        for row, plain in live.items():
            if rng.random() < 0.03:  # preempted and resumed: fresh blocks, recompute all
                plain.blocks, plain.computed = blocks_for(len(plain.tokens)), 0
                batch.set_blocks(row, plain.blocks)
                batch.num_computed_tokens[row] = 0
        if not live:
            continue
        rows = [r for r in live if len(live[r].tokens) < MAX_LEN and rng.random() < 0.8]
        if not rows:
            continue
        rng.shuffle(rows)  # the scheduler's order, not the rows'
        num_sched = []
        for row in rows:
            plain = live[row]
            n = rng.randrange(1, len(plain.tokens) - plain.computed + 1)
            new_blocks = blocks_for(plain.computed + n, have=len(plain.blocks))
            plain.blocks += new_blocks
            batch.append_blocks(row, new_blocks)
            num_sched.append(n)
        plains = [live[r] for r in rows]
        want = expected_inputs(plains, num_sched)
        step_inputs = builder.build(batch, np.asarray(rows), num_sched)
        meta = step_inputs.attn_metadata
        assert step_inputs.input_ids.tolist() == want["ids"]
        assert step_inputs.positions.tolist() == want["positions"]
        assert meta.slot_mapping.tolist() == want["slots"]
        assert step_inputs.sampling_rows == want["sampled"]
        assert meta.seq_lens.tolist() == [
            p.computed + n for p, n in zip(plains, num_sched, strict=True)
        ]
        for i, p in enumerate(plains):
            assert meta.block_table[i, : len(p.blocks)].tolist() == p.blocks
        # What the runner does after sampling.
        sampled_rows = [rows[i] for i in want["sampled"]]
        tokens = [rng.randrange(1, 1000) for _ in sampled_rows]
        batch.append_tokens(np.asarray(sampled_rows, dtype=np.int64), tokens)
        for row, token in zip(sampled_rows, tokens, strict=True):
            live[row].tokens.append(token)
        batch.num_computed_tokens[rows] += num_sched
        for row, n in zip(rows, num_sched, strict=True):
            live[row].computed += n
        for row, plain in live.items():
            assert batch.num_tokens[row] == len(plain.tokens)
            assert batch.token_ids[row, : len(plain.tokens)].tolist() == plain.tokens
    assert batch.num_rows == 64, "40 requests at once should have grown the rows to 64"


def test_a_freed_row_is_reused_and_a_full_batch_grows():
    batch = PersistentBatch(max_num_seqs=4, max_model_len=8, max_blocks_per_seq=2)
    rows = [batch.add([i + 1], [i], 0) for i in range(4)]
    assert sorted(rows) == [0, 1, 2, 3] and batch.num_rows == 4
    batch.remove(rows[1])
    assert batch.add([9, 9], [7], 0) == rows[1]
    assert batch.token_ids[rows[1], :2].tolist() == [9, 9] and batch.num_tokens[rows[1]] == 2
    # Preempted requests keep rows too, so the batch may hold more than max_num_seqs.
    extra = batch.add([5], [6], 0)
    assert batch.num_rows == 8 and extra >= 4
    assert batch.token_ids[rows[0], 0] == 1 and batch.block_table[rows[3], 0] == 3
