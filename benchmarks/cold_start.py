"""Cold start with a shared model cache: start-to-ready of a first and a second replica.

What a pod of an LLMDeployment with `spec.model.cache` does, run here as processes: its init
container runs `tidegate fetch-model --shared URI CACHE/models/...`, then the engine runs
`tidegate serve` with `--compile-cache-dir CACHE/compile/...`. The first replica finds the
cache empty: it downloads the model (a .tar.gz of the tiny model, served over HTTP from this
machine) and compiles from cold. The second, started after the first is ready, finds both in
the cache. Each repeat starts from an empty cache; the figure kept is each replica's median.

    .venv/bin/python benchmarks/cold_start.py --repeats 2
    .venv/bin/python benchmarks/cold_start.py --smoke   # eager, one repeat: seconds, for CI
"""

from __future__ import annotations

import http.server
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from common import machine, model_dir, scenario_parser, table, update_readme, write_result
from tidegate.common.local_server import LocalServer, tidegate_command

REPLICAS = ("first", "second")


class ModelServer:
    """Serves a folder over HTTP on this machine and counts the downloads."""

    def __init__(self, folder: Path) -> None:
        self.downloads = 0
        owner = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, directory=str(folder), **kwargs)  # type: ignore[misc]

            def do_GET(self) -> None:
                owner.downloads += 1
                super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/{name}"


def start_replica(uri: str, cache: Path, level: int) -> dict:
    """One replica's start: fetch into the cache (init container), then serve until healthy."""
    model, compiled = cache / "models" / "tiny", cache / "compile" / "tiny"
    started = time.monotonic()
    fetch = [*tidegate_command(), "fetch-model", "--shared", uri, str(model)]
    subprocess.run(fetch, check=True, stdout=subprocess.DEVNULL, timeout=300)
    fetched = time.monotonic()
    flags = ("--served-model-name", "m", "--log-level", "warning")
    flags += ("--compilation-level", str(level), "--compile-cache-dir", str(compiled))
    server = LocalServer.tidegate_serve(model, *flags, log=subprocess.DEVNULL)
    try:
        server.wait_healthy(deadline_s=600)
        ready = time.monotonic()
    finally:
        server.stop()
    return {
        "fetch_s": round(fetched - started, 3),
        "serve_to_healthy_s": round(ready - fetched, 3),
        "start_to_ready_s": round(ready - started, 3),
        # A warm start finds its kernels there and adds few or none.
        "compile_cache_files": sum(1 for path in compiled.rglob("*") if path.is_file()),
    }


def main() -> None:
    parser = scenario_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compilation-level", type=int, default=1, choices=[0, 1])
    args = parser.parse_args()
    level = 0 if args.smoke else args.compilation_level
    repeats = 1 if args.smoke else args.repeats
    load_at_start = round(os.getloadavg()[0], 2)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        archive = root / "served" / "tiny.tar.gz"
        archive.parent.mkdir()
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(model_dir("tiny"), arcname=".")
        source = ModelServer(archive.parent)
        for repeat in range(repeats):
            cache = root / f"cache-{repeat}"  # what a node's hostPath or a claim holds
            for replica in REPLICAS:
                before = source.downloads
                run = start_replica(source.url(archive.name), cache, level)
                run.update(repeat=repeat, replica=replica, downloads=source.downloads - before)
                print(run, flush=True)
                runs.append(run)
        source.http.shutdown()
    record = {
        "command": "python benchmarks/cold_start.py " + " ".join(sys.argv[1:]),
        "machine": {**machine(), "load_average_1m_at_start": load_at_start},
        "model": "tiny llama (make-tiny-model), as a .tar.gz over HTTP on this machine",
        "compilation_level": level,
        "repeats": repeats,
        "summary": summarize(runs),
        "runs": runs,
    }
    print(f"wrote {write_result('cold_start', record, args.out_dir)}")
    update_readme(args.readme, "cold-start", readme_section(record))


def summarize(runs: list[dict]) -> dict:
    """Each replica's median of every time, and the most downloads any of its runs made."""
    summary = {}
    for replica in REPLICAS:
        mine = [r for r in runs if r["replica"] == replica]
        times = ("fetch_s", "serve_to_healthy_s", "start_to_ready_s")
        summary[replica] = {key: round(statistics.median(r[key] for r in mine), 3) for key in times}
        summary[replica]["downloads"] = max(r["downloads"] for r in mine)
    return summary


def readme_section(record: dict) -> str:
    """The README's table of a record, with the load it was measured under."""
    rows = [
        [replica, s["downloads"], s["fetch_s"], s["serve_to_healthy_s"], s["start_to_ready_s"]]
        for replica, s in record["summary"].items()
    ]
    header = [
        "replica",
        "downloads (most of a run)",
        "fetch (s)",
        "serve to healthy (s)",
        "start to ready (s)",
    ]
    level, repeats = record["compilation_level"], record["repeats"]
    title = f"### cold-start (tiny model, compilation level {level}, median of {repeats})"
    where = record["machine"]
    load = (
        f"Load average {where['load_average_1m_at_start']} at the start and "
        f"{where['load_average_1m_at_end']} at the end, on {where['cpus']} cores: with other "
        "work beside it, both starts are slower than on a quiet machine."
    )
    return f"{title}\n\n{table(header, rows)}\n\n{load}"


if __name__ == "__main__":
    main()
