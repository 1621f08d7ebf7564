"""`tidegate fetch-model --shared`: pods that start together fill a shared cache once.

Real `tidegate fetch-model` processes against a local HTTP server that counts the downloads
and holds the first one open until the test lets it go, so that the others are sure to
arrive while it is under way (they are seen waiting on the lock in /proc/locks).
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.engine.entrypoints.test_fetch_model import make_archive, make_model_folder
from tidegate.engine.entrypoints.fetch_model import DONE_MARKER

CLI = [sys.executable, "-m", "tidegate.cli", "fetch-model", "--shared"]
DEADLINE_S = 30.0


@dataclass
class ModelServer:
    """Serves one archive; counts GETs; holds each response until `release` is set."""

    archive: Path
    gets: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.gets += 1
                owner.started.set()
                body = owner.archive.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:100])
                self.wfile.flush()
                owner.release.wait(DEADLINE_S)
                self.wfile.write(body[100:])

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ModelServer, str]]:
    folder = make_model_folder(tmp_path / "m")
    model = ModelServer(make_archive(folder, tmp_path / "m.tar.gz"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), model.handler())
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield model, f"http://127.0.0.1:{server.server_address[1]}/m.tar.gz"
    finally:
        model.release.set()
        server.shutdown()


def lock_waiters(lock_file: Path) -> int:
    """How many processes are blocked on a lock of `lock_file` (Linux's /proc/locks)."""
    inode = os.stat(lock_file).st_ino
    return sum(
        1
        for line in Path("/proc/locks").read_text().splitlines()
        if "->" in line and line.split()[6].endswith(f":{inode}")
    )


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_concurrent_fetchers_download_once_and_all_find_the_model(served, tmp_path: Path):
    model, uri = served
    dest = tmp_path / "cache" / "models" / "abc"
    first = subprocess.Popen([*CLI, uri, str(dest)], stdout=subprocess.PIPE, text=True)
    assert model.started.wait(DEADLINE_S), "the first fetcher never asked for the archive"
    others = [
        subprocess.Popen([*CLI, uri, str(dest)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    wait_for(lambda: lock_waiters(dest.parent / "abc.lock") == 3, "3 fetchers on the lock")
    assert not dest.exists(), "the folder appeared before its download ended"
    model.release.set()
    for process in [first, *others]:
        out, _ = process.communicate(timeout=DEADLINE_S)
        assert process.returncode == 0
        assert out.strip() == str(dest)
    assert model.gets == 1
    assert (dest / "config.json").read_text() == '{"model_type": "llama"}'
    assert (dest / DONE_MARKER).read_text() == uri
    assert sorted(p.name for p in dest.parent.iterdir()) == ["abc", "abc.lock"]


def test_a_fetcher_killed_mid_download_leaves_nothing_taken_for_the_model(served, tmp_path):
    model, uri = served
    dest = tmp_path / "cache" / "models" / "abc"
    doomed = subprocess.Popen([*CLI, uri, str(dest)], stdout=subprocess.DEVNULL)
    assert model.started.wait(DEADLINE_S)
    waiting = subprocess.Popen([*CLI, uri, str(dest)], stdout=subprocess.PIPE, text=True)
    wait_for(lambda: lock_waiters(dest.parent / "abc.lock") == 1, "the second fetcher waiting")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(DEADLINE_S)
    assert not dest.exists(), "a half download was put in place"
    # The kernel released the dead one's lock: the waiting one starts over, on its own.
    model.release.set()
    out, _ = waiting.communicate(timeout=DEADLINE_S)
    assert waiting.returncode == 0, out
    assert model.gets == 2
    assert (dest / "model.safetensors").stat().st_size == 1024
    assert not (dest.parent / ".abc.partial").exists()
