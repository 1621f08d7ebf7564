"""pipeline-parallel: offline throughput of one worker against two pipeline stages, with the
stages overlapping on micro-batches or running one step at a time; and the pipeline bubble.

Same model folder, same prompts (random token ids, fixed seed), greedy, EOS ignored. Each arm
runs `LLM(...).generate` `--repeats` times, alternating between arms (pp1, pp2, pp2-sync,
pp1, ...) so a change of the machine's load hits every arm; the median run of each is kept,
and every arm's tokens are compared with pp1's. In bf16 a few sequences may differ after some
tokens: two stages run one torch thread each where one worker runs two, so the matmuls sum in
another order and round differently (in float32 the tokens are equal; the tests check that).

The bubble is the share of the wall time a stage's worker did not compute: 1 - its CPU time
over the run's wall time, averaged over the stages. Each worker runs one torch thread here
(the machine's cores divided among the ranks) and waits for the other stage in the kernel
(gloo's receive), so its CPU time is its busy time. With one step at a time each stage
idles while the other computes (a bubble near 1 - 1/stages); micro-batches fill it.

On a 2-core machine PP buys memory per process, not speed: two stages share the two cores
that one worker would use whole, and add a send and a receive of the hidden states per step.

    python benchmarks/pipeline_parallel.py           # small model, writes results/pipeline_parallel.json
    python benchmarks/pipeline_parallel.py --smoke   # tiny model, seconds
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from parallel_sizes import make_prompts, offline_parser

from common import README, machine, model_dir, table, update_readme, write_result

# arm -> LLM arguments
ARMS = {
    "pp1": {},
    "pp2": {"pipeline_parallel_size": 2},
    "pp2-sync": {"pipeline_parallel_size": 2, "pipeline_micro_batching": False},
}


def stage_workers() -> list[psutil.Process]:
    """This process's stage workers (tidegate::worker_pp<s>_tp0), by stage."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            title = " ".join(child.cmdline())
            if title.startswith("tidegate::worker_pp"):
                found.append((title, child))
    return [process for _, process in sorted(found, key=lambda pair: pair[0])]


def cpu_seconds(processes: list[psutil.Process]) -> list[float]:
    times = [p.cpu_times() for p in processes]
    return [t.user + t.system for t in times]


class Arm:
    """One arm's engine, started once and timed on every turn it gets."""

    def __init__(self, name: str, model: Path, args) -> None:
        from tidegate.engine import LLM, SamplingParams

        self.name = name
        others = {p.pid for p in stage_workers()}  # the arms started before this one
        started = time.perf_counter()
        self.llm = LLM(model=str(model), dtype=args.dtype, **ARMS[name])
        self.startup_s = time.perf_counter() - started
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.workers = [p for p in stage_workers() if p.pid not in others]
        self.runs: list[dict] = []
        self.outputs: list[list[int]] | None = None

    def run(self, prompts: list[list[int]]) -> None:
        before = cpu_seconds(self.workers)
        start = time.perf_counter()
        outputs = [o.outputs[0].token_ids for o in self.llm.generate(prompts, self.params)]
        wall = time.perf_counter() - start
        busy = [(b - a) / wall for a, b in zip(before, cpu_seconds(self.workers), strict=True)]
        generated = sum(map(len, outputs))
        run = {"seconds": wall, "output_tokens_per_s": generated / wall}
        if busy:
            run["stage_busy"] = [round(b, 3) for b in busy]
            run["bubble"] = round(1 - statistics.mean(min(b, 1.0) for b in busy), 3)
        self.runs.append(run)
        self.outputs = outputs

    def summary(self) -> dict:
        median = sorted(self.runs, key=lambda r: r["seconds"])[len(self.runs) // 2]
        return {
            **median,
            "all_output_tokens_per_s": [round(r["output_tokens_per_s"], 1) for r in self.runs],
            "startup_s": round(self.startup_s, 2),
        }

    def close(self) -> None:
        self.llm.close()


def fresh(prompts: list[list[int]], turn: int, vocab: int) -> list[list[int]]:
    """The prompts with their first token moved by `turn`: nothing the prefix cache holds."""
    return [[(p[0] + turn - 6) % (vocab - 6) + 6, *p[1:]] for p in prompts]


@contextlib.contextmanager
def arms(names: list[str], model: Path, args) -> Iterator[list[Arm]]:
    started: list[Arm] = []
    try:
        for name in names:
            started.append(Arm(name, model, args))
        yield started
    finally:
        for arm in started:
            arm.close()


def main() -> None:
    parser = offline_parser(__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args()
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.repeats = 4, 16, 8, 1
        args.dtype = "float32"  # the tokens must then equal pp1's
    size = "tiny" if args.smoke else "small"
    model = model_dir(size)
    from tidegate.engine.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(vocab, args.num_prompts, args.input_len, seed=0)
    # One arm's engine at a time would leave the others' workers idle but resident; all are
    # started first so the turns can alternate.
    with arms(list(ARMS), model, args) as started:
        for arm in started:  # warm up: the same shapes, on prompts never timed
            arm.llm.generate([p[::-1] for p in prompts[:2]], arm.params)
        load = []
        for turn in range(args.repeats):
            for arm in started:
                arm.run(fresh(prompts, turn, vocab))
                load.append(round(psutil.getloadavg()[0], 2))
        reference = started[0].outputs
        results = {}
        for arm in started:
            differing = sum(a != b for a, b in zip(arm.outputs, reference, strict=True))
            results[arm.name] = {
                **arm.summary(),
                "tokens_match_pp1": differing == 0,
                "sequences_differing": differing,
            }
    for name, result in results.items():
        bubble = f", bubble {result['bubble']:.0%}" if "bubble" in result else ""
        print(
            f"{name}: {result['output_tokens_per_s']:.1f} output tok/s{bubble}, "
            f"sequences differing from pp1: {result['sequences_differing']}"
        )
    record = {
        "model": size,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "results": results,
        "load_average_1m_per_turn": load,
        "machine": machine(),
    }
    print(f"wrote {write_result('pipeline_parallel', record, args.out_dir)}")
    if args.smoke:
        return
    base = results["pp1"]["output_tokens_per_s"]
    rows = [
        [
            name,
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['output_tokens_per_s'] / base:.2f}x",
            f"{r['bubble']:.0%}" if "bubble" in r else "-",
            " / ".join(f"{b:.0%}" for b in r.get("stage_busy", [])) or "-",
            f"{r['sequences_differing']} of {args.num_prompts}",
        ]
        for name, r in results.items()
    ]
    header = ["arm", "output tok/s", "vs pp1", "bubble", "stage busy", "differ from pp1"]
    update_readme(args.readme, "pipeline-parallel", table(header, rows))


if __name__ == "__main__":
    main()
