"""structured-backends: xgrammar against llguidance on the corpus of structured outputs.

For both test tokenizers (tiny: 1,024 tokens and logits; small: 3,967 tokens, 32,000 logits),
each backend's start (a fresh process importing the library and building its tokenizer index),
the compile of every constraint of tests/fixtures/structured/schemas.json (cold, then from the
manager's cache), a new matcher, and the per-token cost while walking a valid output: the
bitmask fill and the accept. The outputs are walked once with xgrammar (seeded, biased to end)
and replayed on both, so both backends time the same tokens. Then batch fills of matchers that
advance a token between fills, one by one and on the library's threads (BATCH_FILL_MIN).

The default ("auto") is the backend that serves the whole corpus once from a cold start in
less engine-core time (start + every cold compile + matcher + every fill and accept) on the
small model's tokenizer: what the first requests of a fresh server wait for. The steady state
(cached compiles, per-token work) is recorded beside it, with the figure each backend wins.

    python benchmarks/structured_backends.py
    python benchmarks/structured_backends.py --smoke
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import ROOT, machine, model_dir, scenario_parser, write_result
from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.structured_output import StructuredOutputManager, create_backend

CORPUS = ROOT / "tests" / "fixtures" / "structured" / "schemas.json"
BACKENDS = ("xgrammar", "guidance")
EOS_ID = 2  # the tiny models' </s>
STEADY_BATCH = 16  # the decode batch whose per-step fill is reported
BATCH_SIZES = (1, 2, 4, 8, 16, 64)
COMPILE_REPEATS = 3


def constraints(smoke: bool) -> dict[str, StructuredOutputsParams]:
    """Every constraint of the corpus, by name."""
    corpus = json.loads(CORPUS.read_text())
    named = {
        f"json:{k}": StructuredOutputsParams(json=json.dumps(v))
        for k, v in corpus["schemas"].items()
    }
    named["json_object"] = StructuredOutputsParams(json_object=True)
    named |= {f"regex:{r}": StructuredOutputsParams(regex=r) for r in corpus["regexes"]}
    named |= {f"choice:{c[0]}": StructuredOutputsParams(choice=c) for c in corpus["choices"]}
    named |= {
        f"grammar:{g['name']}": StructuredOutputsParams(grammar=g.get("ebnf") or g["lark"])
        for g in corpus["grammars"]
    }
    return dict(list(named.items())[:6]) if smoke else named


def vocab_size(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def start_seconds(name: str, folder: Path, repeats: int) -> dict:
    """Median seconds of a fresh process's import and of create_backend, and its memory then
    (the engine core imports neither torch nor transformers until a grammar library does)."""
    code = (
        "import time, sys\n"
        "t0 = time.perf_counter()\n"
        "from tidegate.engine.structured_output import create_backend\n"
        f"from tidegate.engine.structured_output import {name}_backend\n"
        "t1 = time.perf_counter()\n"
        f"create_backend({name!r}, {str(folder)!r}, {vocab_size(folder)}, [{EOS_ID}])\n"
        "t2 = time.perf_counter()\n"
        # VmHWM: this process's peak (ru_maxrss would count the parent's size before exec).
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(t1 - t0, t2 - t1, hwm.split()[1])\n"
    )
    imports, builds, rss = [], [], []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        )
        first, second, kib = map(float, out.stdout.split())
        imports.append(first)
        builds.append(second)
        rss.append(kib / 1024)
    return {
        "import_s": round(statistics.median(imports), 4),
        "tokenizer_info_s": round(statistics.median(builds), 4),
        "process_max_rss_mb": round(statistics.median(rss), 1),
    }


def first_bytes(folder: Path, size: int) -> np.ndarray:
    """The first byte of each token's text (-1 for special tokens and padding)."""
    import llguidance

    tokenizer = llguidance.LLTokenizer((folder / "tokenizer.json").read_text())
    out = np.full(size, -1, dtype=np.int32)
    for token in range(tokenizer.vocab_size):
        text = tokenizer.decode_bytes([token])
        if text and not tokenizer.is_special_token(token):
            out[token] = text[0]
    return out


def walk_tokens(backend, compiled, first: np.ndarray, seed: int, cap: int = 300) -> list[int]:
    """A valid output (with its EOS when one came), picked as the tests' walker picks."""
    rng = np.random.default_rng(seed)
    matcher = backend.new_matcher(compiled)
    bitmask = np.zeros((1, -(-backend.vocab_size // 32)), dtype=np.int32)
    tokens = []
    for _ in range(cap):
        matcher.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
        ids = np.flatnonzero(bits[: backend.vocab_size])
        if EOS_ID in ids:
            return [*tokens, EOS_ID]
        starts = first[ids]
        closing = ids[np.isin(starts, list(b'"}]'))]
        if len(closing) and rng.random() < 0.5:
            token = int(rng.choice(closing))
        else:
            byte = rng.choice(np.unique(starts))
            token = int(rng.choice(ids[starts == byte]))
        matcher.accept_token(token)
        tokens.append(token)
    return tokens


def time_backend(name: str, folder: Path, named: dict, paths: dict[str, list[int]]) -> dict:
    """Compile (cold, cached), new matcher, fill and accept per token, on one backend."""
    backend = create_backend(name, folder, vocab_size(folder), [EOS_ID])
    manager = StructuredOutputManager(backend, max_cached_grammars=len(named) + 1)
    bitmask = manager.allocate_bitmask(1)
    cold, cached, matcher_s, fill, accept = {}, {}, [], [], []
    refused_replays = []
    for key, params in named.items():
        samples = []
        for _ in range(COMPILE_REPEATS):  # neither library keeps a cache here: each is cold
            start = time.perf_counter()
            backend.compile(params)
            samples.append(time.perf_counter() - start)
        cold[key] = statistics.median(samples)
        compiled = manager.compile_async(params).result()
        start = time.perf_counter()
        manager.compile_async(params).result()
        cached[key] = time.perf_counter() - start
        start = time.perf_counter()
        matcher = manager.new_matcher(compiled)
        matcher_s.append(time.perf_counter() - start)
        for token in paths[key]:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            middle = time.perf_counter()
            ok = matcher.accept_token(token)
            end = time.perf_counter()
            fill.append(middle - start)
            accept.append(end - middle)
            if not ok:
                refused_replays.append(key)
                break
    manager.shutdown()
    compile_cold = sorted(cold.values())
    fill.sort()
    return {
        "compile_cold_ms": {
            "median": _ms(statistics.median(compile_cold)),
            "p90": _ms(compile_cold[int(0.9 * (len(compile_cold) - 1))]),
            "max": _ms(compile_cold[-1]),
            "total": _ms(sum(compile_cold)),
            "slowest": max(cold, key=cold.get),
        },
        "compile_cached_us_median": round(statistics.median(cached.values()) * 1e6, 2),
        "new_matcher_us_median": round(statistics.median(matcher_s) * 1e6, 2),
        "new_matcher_ms_total": _ms(sum(matcher_s)),
        "tokens_timed": len(fill),
        "fill_us": {
            "mean": round(statistics.mean(fill) * 1e6, 2),
            "median": round(statistics.median(fill) * 1e6, 2),
            "p99": round(fill[int(0.99 * (len(fill) - 1))] * 1e6, 2),
        },
        "accept_us": {
            "mean": round(statistics.mean(accept) * 1e6, 2),
            "median": round(statistics.median(accept) * 1e6, 2),
        },
        "replays_refused": refused_replays,
        "compile_cold_ms_each": {k: _ms(v) for k, v in cold.items()},
    }


def batch_fill(
    name: str, folder: Path, named: dict, paths: dict[str, list[int]], steps: int
) -> dict:
    """Microseconds per batch fill, one by one and on the library's threads, for matchers that
    each accept their next token between fills (a decode step's state, not a repeated one)."""
    backend = create_backend(name, folder, vocab_size(folder), [EOS_ID])
    keys = [k for k in named if k.startswith("json:") and len(paths[k]) > 8][:16]
    compiled = {k: backend.compile(named[k]) for k in keys}
    module = sys.modules[type(backend).__module__]
    saved = module.BATCH_FILL_MIN
    out = {}
    for size in BATCH_SIZES:
        timings = {}
        for label, threshold in (("one_by_one", 10**9), ("library_batch", 1)):
            module.BATCH_FILL_MIN = threshold
            rows = [paths[keys[i % len(keys)]][:-1] for i in range(size)]  # without the EOS
            matchers = [backend.new_matcher(compiled[keys[i % len(keys)]]) for i in range(size)]
            at = [0] * size
            bitmask = np.zeros((size, -(-backend.vocab_size // 32)), dtype=np.int32)
            samples = []
            for _ in range(steps):
                start = time.perf_counter()
                backend.fill_bitmasks(matchers, bitmask)
                samples.append(time.perf_counter() - start)
                for i, matcher in enumerate(matchers):
                    if at[i] == len(rows[i]):  # start the output again
                        matcher.rollback(at[i])
                        at[i] = 0
                    matcher.accept_token(rows[i][at[i]])
                    at[i] += 1
            timings[label] = round(statistics.median(samples) * 1e6, 1)
        out[str(size)] = timings
    module.BATCH_FILL_MIN = saved
    return out


def cold_corpus_s(record: dict) -> float:
    """Seconds to serve every constraint of the corpus once from a cold start."""
    return round(
        record["import_s"]
        + record["tokenizer_info_s"]
        + (record["compile_cold_ms"]["total"] + record["new_matcher_ms_total"]) / 1e3
        + record["tokens_timed"] * (record["fill_us"]["mean"] + record["accept_us"]["mean"]) / 1e6,
        3,
    )


def steady(record: dict) -> dict:
    """The per-token and per-step figures once grammars are cached."""
    return {
        "per_token_us": round(record["fill_us"]["mean"] + record["accept_us"]["mean"], 2),
        "per_token_p99_fill_us": record["fill_us"]["p99"],
        f"batch_{STEADY_BATCH}_fill_us": min(record["batch_fill_us"][str(STEADY_BATCH)].values()),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def main() -> None:
    parser = scenario_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    sizes = ("tiny",) if args.smoke else ("tiny", "small")
    named = constraints(args.smoke)
    repeats, steps = (1, 5) if args.smoke else (3, 200)
    results: dict = {}
    for size in sizes:
        folder = model_dir(size)
        walker = create_backend("xgrammar", folder, vocab_size(folder), [EOS_ID])
        first = first_bytes(folder, vocab_size(folder))
        paths = {
            key: walk_tokens(walker, walker.compile(params), first, seed=i)
            for i, (key, params) in enumerate(named.items())
        }
        del walker
        results[size] = {"vocab_size": vocab_size(folder)}
        for name in BACKENDS:
            record = start_seconds(name, folder, repeats)
            record |= time_backend(name, folder, named, paths)
            record["batch_fill_us"] = batch_fill(name, folder, named, paths, steps)
            record["cold_corpus_s"] = cold_corpus_s(record)
            record["steady"] = steady(record)
            results[size][name] = record
            print(
                f"{size} {name}: start {record['import_s']} s + {record['tokenizer_info_s']} s, "
                f"compile median {record['compile_cold_ms']['median']} ms, "
                f"fill {record['fill_us']['mean']} us, accept {record['accept_us']['mean']} us, "
                f"cold corpus {record['cold_corpus_s']} s, steady {record['steady']}"
            )
    decider = results[sizes[-1]]
    default = min(BACKENDS, key=lambda name: decider[name]["cold_corpus_s"])
    other = _other(default)
    mine, theirs = decider[default], decider[other]
    record = {
        "default": default,
        "why": (
            f"on the {sizes[-1]} model's tokenizer, a cold start serving the corpus once costs "
            f"{mine['cold_corpus_s']} s with {default} against {theirs['cold_corpus_s']} s with "
            f"{other}: start {_start(mine)} s against {_start(theirs)} s (the process then holds "
            f"{mine['process_max_rss_mb']} MB against {theirs['process_max_rss_mb']} MB), "
            f"cold compile median "
            f"{mine['compile_cold_ms']['median']} ms against {theirs['compile_cold_ms']['median']}"
            f" ms (max {mine['compile_cold_ms']['max']} against "
            f"{theirs['compile_cold_ms']['max']} ms). Once grammars are cached a token costs "
            f"{mine['steady']['per_token_us']} us with {default} and "
            f"{theirs['steady']['per_token_us']} us with {other} (fill + accept), a "
            f"{STEADY_BATCH}-row step's fill {mine['steady'][f'batch_{STEADY_BATCH}_fill_us']} us "
            f"against {theirs['steady'][f'batch_{STEADY_BATCH}_fill_us']} us"
        ),
        "constraints": len(named),
        "results": results,
        "load_average_at_start": load_at_start,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": "python benchmarks/structured_backends.py" + (" --smoke" if args.smoke else ""),
        "machine": machine(),
    }
    print(f"default: {default} ({record['why']})")
    print(f"wrote {write_result('structured_backends', record, args.out_dir)}")


def _other(name: str) -> str:
    return BACKENDS[1 - BACKENDS.index(name)]


def _start(record: dict) -> float:
    return round(record["import_s"] + record["tokenizer_info_s"], 3)


if __name__ == "__main__":
    main()
