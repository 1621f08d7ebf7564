"""input-batch: the host time of one step's input building, from the runner's persistent batch.

Decode-only steps of 1, 32 and 256 requests (block size 16): `InputBuilder.build` gathers
input ids, positions, slots and block tables from the rows with numpy, then the runner's
per-step bookkeeping (appending sampled tokens, advancing computed counts) runs as it does
after sampling. Median of 5 repeats of 300 steps each.

    python benchmarks/input_batch.py
    python benchmarks/input_batch.py --smoke
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from common import machine, scenario_parser, table, update_readme, write_result
from tidegate.engine.worker.input_batch import InputBuilder, PersistentBatch

MAX_MODEL_LEN, BLOCK = 4096, 16
CASES = [(1, 512), (32, 640), (256, 2048)]  # (requests, context)


def time_case(num_seqs: int, context: int, steps: int, repeats: int) -> float:
    """Median milliseconds of build + bookkeeping for one decode step of num_seqs requests."""
    max_blocks = MAX_MODEL_LEN // BLOCK
    batch = PersistentBatch(256, MAX_MODEL_LEN, max_blocks)
    builder = InputBuilder(8192, 256, max_blocks, BLOCK, torch.device("cpu"))
    per_seq = context // BLOCK + 1
    rows = np.asarray(
        [
            batch.add(
                list(range(context)), list(range(i * per_seq, (i + 1) * per_seq)), context - 1
            )
            for i in range(num_seqs)
        ]
    )
    scheduled = [1] * num_seqs
    tokens = [7] * num_seqs
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step = builder.build(batch, rows, scheduled)
            batch.append_tokens(rows[step.sampling_rows], tokens)
            batch.num_computed_tokens[rows] += scheduled
            batch.num_tokens[rows] -= 1  # the same context every step
            batch.num_computed_tokens[rows] -= 1
        samples.append((time.perf_counter() - start) / steps * 1e3)
    return round(statistics.median(samples), 4)


def main() -> None:
    parser = scenario_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    steps, repeats = (20, 1) if args.smoke else (300, 5)
    rows = []
    results = []
    for num_seqs, context in CASES:
        ms = time_case(num_seqs, context, steps, repeats)
        results.append({"requests": num_seqs, "context": context, "ms_per_step": ms})
        rows.append([num_seqs, context, ms])
        print(f"{num_seqs} requests, context {context}: {ms} ms per step")
    record = {"cases": results, "steps": steps, "repeats": repeats, "machine": machine()}
    print(f"wrote {write_result('input_batch', record, args.out_dir)}")
    update_readme(
        args.readme,
        "input-batch",
        "### input building per decode step (host time)\n\n"
        + table(["requests", "context", "ms per step"], rows)
        + "\n\n`python benchmarks/input_batch.py`: `InputBuilder.build` from the persistent "
        "batch plus the runner's per-step bookkeeping, median of 5 repeats of 300 steps.",
    )


if __name__ == "__main__":
    main()
