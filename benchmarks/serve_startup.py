"""Startup of `tidegate serve`: seconds from launch to /health 200 and to the first completion.

Runs the real command (API server, engine core and worker processes) several times on a
tiny model made on the spot, and writes a JSON record.

    python benchmarks/serve_startup.py --runs 5 --out benchmarks/results/serve_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tidegate.common.local_server import LocalServer


def one_run(model_dir: Path, size: str) -> dict:
    """Launch, wait for /health, send one completion, stop; the seconds of each phase."""
    flags = ("--served-model-name", "m", "--log-level", "warning")
    server = LocalServer.tidegate_serve(model_dir, *flags, log=subprocess.DEVNULL)
    try:
        healthy = server.wait_healthy().startup_seconds
        body = json.dumps({"model": "m", "prompt": "The tide", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{server.base_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            json.load(response)
        first = time.monotonic() - server.started_at
    finally:
        stop_started = time.monotonic()
        code = server.stop()
    return {
        "size": size,
        "seconds_to_healthy": round(healthy or 0.0, 3),
        "seconds_to_first_completion": round(first, 3),
        "seconds_to_stop": round(time.monotonic() - stop_started, 3),
        "exit_code": code,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tidegate.engine.tiny_model import make_tiny_model

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = make_tiny_model(Path(tmp) / size, arch="llama", size=size)
            one_run(model_dir, size)  # warm the page cache, as a restarted pod would have it
            runs += [one_run(model_dir, size) for _ in range(args.runs)]
    summary = {}
    for size in args.sizes:
        mine = [r for r in runs if r["size"] == size]
        summary[size] = {
            key: {
                "median": statistics.median(r[key] for r in mine),
                "min": min(r[key] for r in mine),
                "max": max(r[key] for r in mine),
            }
            for key in ("seconds_to_healthy", "seconds_to_first_completion", "seconds_to_stop")
        }
    record = {
        "benchmark": "serve_startup",
        "command": "python benchmarks/serve_startup.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "note": "vLLM's CPU build takes 23-26 s to become healthy on this kind of machine "
        "(figure from the issue, not measured in this run)",
        "compilation": "the engine's default level (1 on CPU: compiled before /health turns "
        "healthy); the unmeasured first run of each size fills inductor's cache, so these are "
        "warm starts; with --enforce-eager a start took about 2 s",
        "summary": summary,
        "runs": runs,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
