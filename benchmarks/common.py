"""What the benchmark scenarios share: model folders, metrics scraping, the results README."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tidegate.common.local_server import LocalServer
from tidegate.engine.bench.workloads import Workload, long_prompt_arrival_workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
# Where `make bench-peers` (benchmarks/peers/setup_vllm.sh) sets up vLLM's CPU build.
PEERS = ROOT / ".cache" / "peers"


def model_dir(size: str, root: Path | None = None) -> Path:
    """A tiny-model folder of this size (`tidegate make-tiny-model`), made once."""
    from tidegate.engine.tiny_model import make_tiny_model

    folder = (root or ROOT / ".cache" / "models") / f"{size}-llama"
    if not (folder / "config.json").is_file():
        make_tiny_model(folder, arch="llama", size=size)
    return folder


def peer_python(peers: Path = PEERS) -> Path:
    """The interpreter of the peer venv that setup_vllm.sh builds under `peers`."""
    return peers / "vllm-venv" / "bin" / "python"


def check_peers(peers: Path = PEERS) -> None:
    """Exit with what to run when the peer is not set up under `peers`."""
    if not (peers / "vllm-env.sh").is_file():
        raise SystemExit(f"vLLM is not installed in {peers}: run `make bench-peers`")


def in_peer_env(command: list[str], peers: Path = PEERS) -> list[str]:
    """`command` under bash, in the environment setup_vllm.sh wrote for the peer venv."""
    script = f"source {shlex.quote(str(peers / 'vllm-env.sh'))} && exec {shlex.join(command)}"
    return ["bash", "-c", script]


def run_in_peer_env(
    command: list[str], peers: Path = PEERS, timeout: int = 1800, cwd: str | None = None
) -> None:
    """Run `command` in the peer venv's environment (`in_peer_env`); CalledProcessError if it
    fails. In a session of its own, ended whole afterwards: vLLM's engine-core and worker
    processes outlive a script that exits before shutting them down (its teardown may abort),
    and left behind they spin on the cores that every later run measures."""
    peer = subprocess.Popen(in_peer_env(command, peers), start_new_session=True, cwd=cwd)
    try:
        code = peer.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(peer.pid, signal.SIGKILL)
        peer.wait()
    if code != 0:
        raise subprocess.CalledProcessError(code, command)


def run_peer_script(
    script: Path, arguments: list[str], timeout: int = 1800, peers: Path = PEERS
) -> dict:
    """Run a benchmarks/peers script in vLLM's venv (make bench-peers, under `peers`), with
    `--out FILE` added; returns the JSON it wrote there."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        command = [str(peer_python(peers)), str(script), *arguments, "--out", str(out)]
        run_in_peer_env(command, peers, timeout)
        return json.loads(out.read_text())


def scenario_parser(description: str | None, smoke: bool = True) -> argparse.ArgumentParser:
    """The flags every scenario takes: where results and the README table go, and --smoke."""
    parser = argparse.ArgumentParser(description=description)
    if smoke:
        parser.add_argument("--smoke", action="store_true", help="tiny model, seconds, for CI")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=README)
    return parser


def tidegate_server(model: Path, *flags: str) -> LocalServer:
    """`tidegate serve` as every scenario runs it: the model served as "m", bf16, quiet."""
    common = ("--served-model-name", "m", "--dtype", "bfloat16")
    return LocalServer.tidegate_serve(model, *common, *flags, log=subprocess.DEVNULL)


def machine() -> dict:
    """Where a result was measured."""
    # The load average says whether something else ran beside the measurement.
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
    }


def scrape(base_url: str) -> dict[str, float]:
    """Unlabelled view of /metrics: sample name -> value (the last series of a name wins)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def write_result(name: str, record: dict, out_dir: Path) -> Path:
    """benchmarks/results/NAME.json (or under out_dir)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    record = {"benchmark": name, "measured_at": time.strftime("%Y-%m-%d %H:%M"), **record}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def update_readme(readme: Path, section: str, markdown: str) -> None:
    """Replace the text between `<!-- SECTION -->` and `<!-- /SECTION -->` (append if absent)."""
    start, end = f"<!-- {section} -->", f"<!-- /{section} -->"
    text = readme.read_text() if readme.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n{block}\n"
    readme.write_text(text)


def table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def lookup(tree: dict, *keys: str) -> object:
    """tree[k1][k2]... or None where a level is missing (a run too short to measure)."""
    for key in keys:
        if not isinstance(tree, dict) or tree.get(key) is None:
            return None
        tree = tree[key]
    return tree


@dataclass(frozen=True)
class StallScenario:
    """Steady streams decoding while long prompts arrive: its sizes and the workload."""

    size: str
    streams: int
    steady_out: int
    long_len: tuple[int, int]
    arrivals: list[float]

    @property
    def model(self) -> Path:
        return model_dir(self.size)

    def workload(self) -> Workload:
        return long_prompt_arrival_workload(
            num_steady=self.streams,
            steady_input_len=64,
            steady_output_len=self.steady_out,
            long_input_len=self.long_len,
            long_arrivals=self.arrivals,
            long_output_len=8,
            seed=0,
        )

    def describe(self) -> dict:
        """The workload's sizes, for the result file."""
        return {
            "steady_streams": self.streams,
            "steady_output_len": self.steady_out,
            "long_input_len": self.long_len,
            "long_arrivals_s": self.arrivals,
        }


def stall_scenario(smoke: bool, smoke_arrivals: list[float] | None = None) -> StallScenario:
    """The prefill-stall workload: small model and 16 streams, or a few seconds for tests."""
    if smoke:
        # Streams long enough to outlast the arrivals on a fast machine: the tiny model makes
        # a token in about 1.6 ms a step on 2 cores, and 500 tokens ended before 1.0 s.
        return StallScenario("tiny", 4, 1500, (1000, 1500), smoke_arrivals or [0.5, 0.8])
    return StallScenario("small", 16, 700, (2048, 3800), [6.0, 10.0])
