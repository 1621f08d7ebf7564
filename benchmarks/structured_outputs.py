"""Structured outputs throughput: a batch with every second request constrained by a JSON
schema against the same batch unconstrained, and the same cases on vLLM's CPU build with the
very same token ids and schemas.

Offline (`LLM.generate`), small model, bf16, greedy with EOS ignored, prefix caching off so
that every repeat computes its prompts. Four schemas spread over the constrained half, each an
array whose `minItems` makes every valid output longer than the output length, so constrained
requests also run to max_tokens and both cases produce the same tokens. Each engine warms up
unconstrained, then times its first constrained run on its own (cold: the grammar library
loads and the four schemas compile), then alternates the cases with the grammars cached.
The engines alternate by round (Tidegate, vLLM, Tidegate, ...). Median of every run.

    python benchmarks/structured_outputs.py            # writes results/structured_outputs.json
    python benchmarks/structured_outputs.py --no-vllm  # Tidegate only
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts

from common import (
    ROOT,
    machine,
    model_dir,
    peer_python,
    run_in_peer_env,
    scenario_parser,
    table,
    update_readme,
    write_result,
)
from tidegate.engine.tokenizer import Tokenizer

PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_structured.py"
# Every valid output is at least MIN_ITEMS objects of 40-odd characters: over 2,500
# characters, more than 128 tokens even if every token were as long as the small model's
# longest (15 bytes).
MIN_ITEMS = 64


def _array_of(properties: dict) -> dict:
    """An array of at least MIN_ITEMS objects with exactly these properties, in this order."""
    return {
        "type": "array",
        "minItems": MIN_ITEMS,
        "items": {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        },
    }


def _string(low: int, high: int) -> dict:
    return {"type": "string", "minLength": low, "maxLength": high}


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


# Each has a bounded string, an integer range, an enum and a nested array.
SCHEMAS = {
    "people": _array_of(
        {
            "name": _string(1, 12),
            "age": _integer(0, 120),
            "role": {"enum": ["admin", "editor", "viewer"]},
            "skills": {"type": "array", "minItems": 1, "maxItems": 3, "items": _string(1, 8)},
        }
    ),
    "orders": _array_of(
        {
            "sku": _string(4, 10),
            "quantity": _integer(1, 99),
            "status": {"enum": ["open", "paid", "shipped", "returned"]},
            "lines": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"price": _integer(0, 9999), "gift": {"type": "boolean"}},
                    "required": ["price", "gift"],
                    "additionalProperties": False,
                },
            },
        }
    ),
    "readings": _array_of(
        {
            "sensor": {"enum": ["north", "south", "east", "west"]},
            "value": _integer(-500, 500),
            "unit": {"enum": ["C", "F", "K"]},
            "history": {
                "type": "array",
                "minItems": 2,
                "maxItems": 4,
                "items": _integer(-500, 500),
            },
            "note": _string(1, 16),
        }
    ),
    "events": _array_of(
        {
            "title": _string(3, 20),
            "day": _integer(1, 31),
            "month": {"enum": ["jan", "feb", "mar", "apr", "may", "jun"]},
            "tags": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"enum": ["work", "home", "travel", "sport"]},
            },
        }
    ),
}
SCHEMA_TEXTS = [json.dumps(schema) for schema in SCHEMAS.values()]
CASES = ("none", "half_constrained")


def plan_cases(num_prompts: int) -> dict[str, list[str | None]]:
    """Per case, the schema text of each prompt (None: unconstrained)."""
    return {
        "none": [None] * num_prompts,
        # Odd prompts are constrained, the schemas taken in turn.
        "half_constrained": [
            SCHEMA_TEXTS[(i // 2) % len(SCHEMA_TEXTS)] if i % 2 else None
            for i in range(num_prompts)
        ],
    }


def run_tidegate(model: Path, plan: dict, output_len: int, repeats: int, backend: str) -> dict:
    """The cases in one engine with this grammar backend: cold run, then alternating repeats."""
    from tidegate.engine import LLM, SamplingParams
    from tidegate.engine.sampling_params import StructuredOutputsParams

    prompts = plan["prompts"]
    counts: dict[str, set[int]] = {case: set() for case in CASES}
    token_ids: dict[str, list[list[int]]] = {}

    def params_of(schema: str | None) -> SamplingParams:
        constraint = None if schema is None else StructuredOutputsParams(json=schema)
        return SamplingParams(
            temperature=0,
            max_tokens=output_len,
            ignore_eos=True,
            structured_outputs=constraint,
        )

    def timed(llm, case: str) -> tuple[float, float]:
        per_prompt = [params_of(schema) for schema in plan["cases"][case]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, per_prompt)
        seconds = time.perf_counter() - start
        counts[case].update(len(o.outputs[0].token_ids) for o in outputs)
        token_ids[case] = [list(o.outputs[0].token_ids) for o in outputs]
        return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, seconds

    runs: dict[str, list[float]] = {case: [] for case in CASES}
    with LLM(
        str(model),
        dtype="bfloat16",
        enable_prefix_caching=False,
        structured_outputs_backend=backend,
    ) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
        cold_rate, cold_s = timed(llm, "half_constrained")
        for _ in range(repeats):
            for case in CASES:
                runs[case].append(timed(llm, case)[0])
        used = _backend_in_use(llm)
    return {
        "backend_config": backend,
        "backends_used": [used] if used else [],
        "cold_half_constrained": {"output_tokens_per_s": cold_rate, "seconds": cold_s},
        "output_tokens_per_s": runs,
        "tokens_per_request": {c: sorted(v) for c, v in counts.items()},
        "output_token_ids": token_ids,
    }


def _backend_in_use(llm) -> str | None:
    """The grammar library an engine resolved its backend to (None if it cannot tell)."""
    try:
        return llm.engine.grammar.manager.backend.name
    except AttributeError:
        return None


def distinct_backends(names: list[str]) -> list[str]:
    """The backends in order, less any explicit one that `auto` already stands for."""
    from tidegate.engine.structured_output.backend import DEFAULT_BACKEND

    seen, kept = set(), []
    for name in names:
        resolved = DEFAULT_BACKEND if name == "auto" else name
        if resolved not in seen:
            seen.add(resolved)
            kept.append(name)
    return kept


def run_vllm(model: Path, plan: dict, output_len: int, repeats: int) -> dict:
    """The same cases in vLLM's CPU build (make bench-peers sets up its venv)."""
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, out = Path(tmp) / "plan.json", Path(tmp) / "vllm.json"
        plan_file.write_text(json.dumps(plan))
        command = [
            str(peer_python()),
            str(PEER_SCRIPT),
            "--model",
            str(model),
            "--plan-json",
            str(plan_file),
            "--output-len",
            str(output_len),
            "--repeats",
            str(repeats),
            "--out",
            str(out),
        ]
        run_in_peer_env(command, timeout=3600, cwd=tempfile.gettempdir())
        return json.loads(out.read_text())


def merge(into: dict, run: dict) -> None:
    """Add one round's runs of an engine to its record so far."""
    for case, values in run["output_tokens_per_s"].items():
        into.setdefault("output_tokens_per_s", {}).setdefault(case, []).extend(values)
    into.setdefault("cold_half_constrained", []).append(run["cold_half_constrained"])
    for case, values in run["tokens_per_request"].items():
        seen = into.setdefault("tokens_per_request", {}).setdefault(case, [])
        seen[:] = sorted(set(seen) | set(values))
    into["backends_used"] = sorted(set(into.get("backends_used", [])) | set(run["backends_used"]))
    into["backend_config"] = run["backend_config"]
    into["output_token_ids"] = run["output_token_ids"]
    for key in ("vllm", "load_seconds"):
        if key in run:
            into[key] = run[key]


def check(record: dict, plan: dict, output_len: int, decode) -> dict:
    """Every request made exactly output_len tokens; constrained ones start as the schema says."""
    # The output tokens decoded on their own: a request's first `text` can also carry the
    # tail of its random prompt (a byte-level prompt that ends inside a UTF-8 character).
    constrained = [
        (SCHEMA_TEXTS.index(schema), decode(ids))
        for schema, ids in zip(
            plan["cases"]["half_constrained"],
            record["output_token_ids"]["half_constrained"],
            strict=True,
        )
        if schema is not None
    ]
    # Whitespace between tokens is the grammar's choice: compare without it.
    starts = ["".join(text.split()).startswith('[{"') for _, text in constrained]
    names = list(SCHEMAS)
    samples = {names[i]: text[:200] for i, text in reversed(constrained)}
    return {
        "every_request_made_output_len_tokens": all(
            counts == [output_len] for counts in record["tokens_per_request"].values()
        ),
        "constrained_outputs_start_with_array_of_objects": all(starts),
        "constrained_starts_ok": f"{sum(starts)}/{len(starts)}",
        "samples": samples,
    }


def summarize(record: dict, plan: dict, output_len: int, decode) -> dict:
    """Medians, the constrained slowdown and the checks of one engine's runs."""
    runs = record["output_tokens_per_s"]
    median = {case: statistics.median(values) for case, values in runs.items()}
    token_ids = record.pop("output_token_ids")
    return {
        **record,
        "median_output_tokens_per_s": median,
        "cold_half_constrained_median_output_tokens_per_s": statistics.median(
            c["output_tokens_per_s"] for c in record["cold_half_constrained"]
        ),
        "slowdown_half_constrained_vs_none": median["none"] / median["half_constrained"],
        "checks": check({**record, "output_token_ids": token_ids}, plan, output_len, decode),
    }


def main() -> None:
    parser = scenario_parser(__doc__.splitlines()[0], smoke=False)
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case per round")
    parser.add_argument("--rounds", type=int, default=3, help="Tidegate-vLLM alternations")
    parser.add_argument(
        "--backends",
        default="auto,xgrammar,guidance",
        help="Tidegate grammar backends, comma-separated; the first is compared with vLLM "
        "(an explicit one that auto stands for is skipped)",
    )
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    model = model_dir(args.size)
    backends = distinct_backends(args.backends.split(","))
    tokenizer = Tokenizer(str(model))
    # Ids the tokenizer knows: with structured outputs on, vLLM rejects any other.
    plan = {
        "prompts": make_prompts(tokenizer.vocab_size, args.num_prompts, args.input_len, seed=0),
        "cases": plan_cases(args.num_prompts),
    }
    ours: dict[str, dict] = {backend: {} for backend in backends}
    theirs: dict = {}
    for _ in range(args.rounds):
        for backend in backends:
            merge(
                ours[backend],
                run_tidegate(model, plan, args.output_len, args.repeats, backend),
            )
        if not args.no_vllm:
            merge(theirs, run_vllm(model, plan, args.output_len, args.repeats))
    decode = tokenizer.decode
    tidegate = {b: summarize(r, plan, args.output_len, decode) for b, r in ours.items()}
    vllm = summarize(theirs, plan, args.output_len, decode) if theirs else {}
    main_backend = tidegate[backends[0]]
    median = main_backend["median_output_tokens_per_s"]
    peer = vllm.get("median_output_tokens_per_s", {})
    record = {
        "workload": {
            "model": f"tidegate make-tiny-model --size {args.size} (llama, bf16)",
            "size": args.size,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "constrained": "every second prompt, 4 JSON schemas in turn (arrays of "
            f"minItems {MIN_ITEMS} objects), ignore_eos on every request",
            "schemas": SCHEMAS,
            "prefix_caching": False,
            "rounds": args.rounds,
            "repeats_per_round": args.repeats,
            "command": shlex.join(["python", "benchmarks/structured_outputs.py", *sys.argv[1:]]),
        },
        "tidegate": tidegate,
        "vllm": vllm,
        # Target: at most 1.10 (half the batch constrained at most 10% slower than none).
        "slowdown_half_constrained_vs_none": {
            "tidegate": main_backend["slowdown_half_constrained_vs_none"],
            **({"vllm": vllm["slowdown_half_constrained_vs_none"]} if vllm else {}),
        },
        "ratio_to_vllm": {case: median[case] / peer[case] for case in peer},
        "machine": machine(),
    }
    path = write_result("structured_outputs", record, args.out_dir)
    print(json.dumps(record, indent=2))
    update_readme(args.readme, "structured_outputs", readme_section(record, path.name))


def readme_section(record: dict, filename: str) -> str:
    """The README table: tokens/s per case and engine, and the slowdowns."""
    work = record["workload"]
    vllm = record["vllm"]
    peer = vllm.get("median_output_tokens_per_s", {})
    columns = [f"Tidegate ({b})" for b in record["tidegate"]]
    rows = []
    for case in (*CASES, "cold"):
        cells = []
        for result in record["tidegate"].values():
            if case == "cold":
                cells.append(result["cold_half_constrained_median_output_tokens_per_s"])
            else:
                cells.append(result["median_output_tokens_per_s"][case])
        if case == "cold":
            theirs = vllm.get("cold_half_constrained_median_output_tokens_per_s")
        else:
            theirs = peer.get(case)
        label = "half constrained, first run (compiles)" if case == "cold" else case
        rows.append(
            [
                label.replace("_", " "),
                *(f"{c:.0f}" for c in cells),
                f"{theirs:.0f}" if theirs else "-",
                f"{cells[0] / theirs:.2f}" if theirs else "-",
            ]
        )
    rows.append(
        [
            "slowdown, half constrained vs none",
            *(f"{r['slowdown_half_constrained_vs_none']:.3f}" for r in record["tidegate"].values()),
            f"{vllm['slowdown_half_constrained_vs_none']:.3f}" if vllm else "-",
            "-",
        ]
    )
    used = ", ".join(
        f"{b}: {'/'.join(r['backends_used']) or '?'}" for b, r in record["tidegate"].items()
    )
    checks = [record["tidegate"][b]["checks"] for b in record["tidegate"]] + (
        [vllm["checks"]] if vllm else []
    )
    all_full = all(c["every_request_made_output_len_tokens"] for c in checks)
    all_start = all(c["constrained_outputs_start_with_array_of_objects"] for c in checks)
    peer_backend = "/".join(vllm.get("backends_used", [])) or "?"
    return (
        f"### structured outputs ({work['size']} model, {work['num_prompts']} prompts x "
        f"{work['input_len']} in / {work['output_len']} out, half of them JSON-schema "
        "constrained)\n\n"
        f"Offline output tokens/s, median of {work['rounds']} round(s) x "
        f"{work['repeats_per_round']} (`{work['command']}`, {filename}; load at end "
        f"{record['machine']['load_average_1m_at_end']}). Grammar libraries: Tidegate {used}; "
        f"vLLM-CPU {vllm.get('vllm', '')} default (auto: {peer_backend}). Every request made "
        f"exactly {work['output_len']} tokens: {'yes' if all_full else 'NO'}; constrained "
        f'outputs start `[{{"`: {"yes" if all_start else "NO"}. Target: half constrained at '
        "most 1.10x slower than none.\n\n"
        + table(["case", *columns, "vLLM-CPU", f"{columns[0]} / vLLM"], rows)
    )


if __name__ == "__main__":
    main()
