"""shared-prefix: a system prompt shared by every session is stored once and computed once.

64 sessions share a 1,000-token system prompt, each with its own short question. The same
workload runs against two servers in one run: prefix caching on, and off. Reported: peak KV
blocks in use (the engine's high-water mark, `tidegate:kv_cache_usage_peak_perc`), TTFT, and
prompt tokens the model actually computed.

    python benchmarks/shared_prefix.py           # writes results/shared_prefix.{json,png}
"""

from __future__ import annotations

from common import (
    machine,
    model_dir,
    scenario_parser,
    scrape,
    table,
    tidegate_server,
    update_readme,
    write_result,
)
from tidegate.engine.bench.plot import plot_run
from tidegate.engine.bench.serve import run_bench
from tidegate.engine.bench.workloads import shared_prefix_workload

CONFIGS = {
    "prefix caching on": ["--enable-prefix-caching"],
    "prefix caching off": ["--no-enable-prefix-caching"],
}
# A fixed pool, so that "usage" converts to blocks and neither run runs out.
NUM_BLOCKS = 8192


def main() -> None:
    args = scenario_parser(__doc__).parse_args()
    size, sessions, output_len = ("tiny", 16, 160) if args.smoke else ("small", 64, 32)
    model = model_dir(size)
    workload = shared_prefix_workload(
        num_prompts=sessions,
        num_prefixes=1,
        prefix_len=1000,
        suffix_len=(16, 32),
        output_len=(output_len, output_len),
        seed=0,
    )
    results, runs = {}, {}
    for label, flags in CONFIGS.items():
        with tidegate_server(model, "--num-gpu-blocks", str(NUM_BLOCKS), *flags) as server:
            server.wait_healthy()
            result, records = run_bench(server.base_url, "m", workload, progress=False)
            totals = scrape(server.base_url)
        results[label] = {
            "flags": flags,
            # The engine's own high-water mark: polling the usage gauge missed the peak when
            # busy cores stretched the polls (CI saw 194 blocks without caching, not 1,180).
            "peak_kv_blocks": round(totals["tidegate:kv_cache_usage_peak_perc"] * NUM_BLOCKS),
            "prompt_tokens": int(totals["tidegate:prompt_tokens_total"]),
            "prompt_tokens_computed": int(totals["tidegate:prompt_tokens_computed_total"]),
            "prefix_cache_hits": int(totals["tidegate:prefix_cache_hits_total"]),
            **result,
        }
        runs[label] = records
        print(
            f"{label:20s} peak blocks {results[label]['peak_kv_blocks']:6d}  "
            f"TTFT mean {result['ttft_ms']['mean']:9.1f} ms p99 {result['ttft_ms']['p99']:9.1f} ms"
            f"  prompt tokens computed {results[label]['prompt_tokens_computed']}",
            flush=True,
        )
    on, off = results["prefix caching on"], results["prefix caching off"]
    targets = {
        "peak KV blocks on / off (target <= 0.1)": round(
            on["peak_kv_blocks"] / max(1, off["peak_kv_blocks"]), 3
        ),
        "mean TTFT off / on (target >= 3)": round(
            off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"], 2
        ),
        "prompt tokens computed on / off": round(
            on["prompt_tokens_computed"] / max(1, off["prompt_tokens_computed"]), 3
        ),
    }
    write_result(
        "shared_prefix",
        {
            "command": "python benchmarks/shared_prefix.py" + (" --smoke" if args.smoke else ""),
            "machine": machine(),
            "model": size,
            "workload": {
                "sessions": sessions,
                "system_prompt_tokens": 1000,
                "question_tokens": "16-32",
                "output_tokens": output_len,
            },
            "targets": targets,
            "results": results,
        },
        args.out_dir,
    )
    plot_run(runs, {}, f"shared-prefix, {size} model", args.out_dir / "shared_prefix.png")
    rows = [
        [
            label,
            r["peak_kv_blocks"],
            r["ttft_ms"]["mean"],
            r["ttft_ms"]["p99"],
            r["prompt_tokens_computed"],
            r["prompt_tokens"],
        ]
        for label, r in results.items()
    ]
    update_readme(
        args.readme,
        "shared-prefix",
        f"### shared-prefix ({size} model, {sessions} sessions, one 1,000-token system prompt)\n\n"
        + table(
            [
                "",
                "peak KV blocks",
                "TTFT mean (ms)",
                "TTFT p99 (ms)",
                "prompt tokens computed",
                "prompt tokens",
            ],
            rows,
        )
        + "\n\n"
        + "\n".join(f"- {name}: **{value}**" for name, value in targets.items())
        + "\n\n![shared-prefix](results/shared_prefix.png)",
    )


if __name__ == "__main__":
    main()
