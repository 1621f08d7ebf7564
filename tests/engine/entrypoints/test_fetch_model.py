"""`tidegate fetch-model`: what an init container runs to put a model where the pod wants it."""

from __future__ import annotations

import http.server
import io
import tarfile
import threading
from pathlib import Path

import pytest

from tidegate.engine.entrypoints.fetch_model import (
    DONE_MARKER,
    FetchError,
    fetch_model,
    fetch_model_shared,
)
from tidegate.engine.lora.adapter import folder_digest, read_adapter
from tidegate.engine.lora.tiny_adapter import make_tiny_adapter
from tidegate.engine.model.config import ModelConfig

NEITHER = r"neither config\.json nor adapter_config\.json"


def make_model_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(b"\0" * 1024)
    (root / "sub").mkdir()
    (root / "sub" / "extra.txt").write_text("x")
    return root


def make_archive(folder: Path, archive: Path, *, top: str | None = None) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            name = str(path.relative_to(folder))
            tar.add(path, arcname=f"{top}/{name}" if top else name, recursive=False)
    return archive


def test_a_tar_of_the_folder_contents_is_unpacked(tmp_path: Path) -> None:
    archive = make_archive(make_model_folder(tmp_path / "m"), tmp_path / "m.tar.gz")
    dest = fetch_model(f"file://{archive}", tmp_path / "dest")
    assert (dest / "config.json").read_text() == '{"model_type": "llama"}'
    assert (dest / "sub" / "extra.txt").read_text() == "x"
    assert not (dest / ".tidegate-download").exists()


def test_a_tar_of_one_named_folder_is_lifted_into_place(tmp_path: Path) -> None:
    folder = make_model_folder(tmp_path / "m")
    archive = make_archive(folder, tmp_path / "m.tgz", top="llama-3-8b")
    dest = fetch_model(f"file://{archive}", tmp_path / "dest")
    assert (dest / "config.json").exists()
    assert (dest / "sub" / "extra.txt").exists()


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("top", [None, "sql-lora"], ids=["contents", "named-folder"])
def test_a_tar_of_a_lora_adapter_folder_is_fetched_as_the_engine_reads_it(
    tiny_llama_dir: Path, tmp_path: Path, top: str | None, shared: bool
) -> None:
    # spec.adapters' uri sources: a PEFT folder has adapter_config.json, no config.json.
    adapter = make_tiny_adapter(tiny_llama_dir, tmp_path / "adapter", rank=4)
    archive = make_archive(adapter, tmp_path / "adapter.tar.gz", top=top)
    fetch = fetch_model_shared if shared else fetch_model
    dest = fetch(f"file://{archive}", tmp_path / "cache" / "sql")
    assert sorted(p.name for p in dest.iterdir()) == [
        DONE_MARKER,
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    info = read_adapter(dest, ModelConfig.from_pretrained(tiny_llama_dir), max_lora_rank=16)
    assert info.rank == 4
    assert info.digest == folder_digest(adapter)  # the same bytes: the same prefix-cache key


def test_over_http_and_a_second_run_does_nothing(tmp_path: Path) -> None:
    archive = make_archive(make_model_folder(tmp_path / "m"), tmp_path / "m.tar")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path), **k
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/{archive.name}"
        dest = fetch_model(uri, tmp_path / "dest")
        assert (dest / DONE_MARKER).read_text() == uri
        (dest / "config.json").write_text("kept")  # a restarted init container: no refetch
        fetch_model(uri, dest)
        assert (dest / "config.json").read_text() == "kept"
    finally:
        server.shutdown()


def test_a_member_that_escapes_the_folder_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        data = b"owned"
        info = tarfile.TarInfo("../outside.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(FetchError, match="refused archive member"):
        fetch_model(f"file://{archive}", tmp_path / "dest")
    assert not (tmp_path / "outside.txt").exists()


def test_unsupported_uris_are_refused_with_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="use http, https or file"):
        fetch_model("s3://bucket/model.tar", tmp_path / "dest")
    with pytest.raises(FetchError, match=r"not a \.tar"):
        fetch_model(f"file://{tmp_path}/model.zip", tmp_path / "dest")


def test_an_archive_of_neither_a_model_nor_an_adapter_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "README").write_text("hi")
    archive = make_archive(folder, tmp_path / "notes.tar")
    with pytest.raises(FetchError, match=NEITHER):
        fetch_model(f"file://{archive}", tmp_path / "dest")
    assert not (tmp_path / "dest" / DONE_MARKER).exists()


def test_shared_a_half_folder_without_the_marker_is_fetched_again(tmp_path: Path) -> None:
    archive = make_archive(make_model_folder(tmp_path / "m"), tmp_path / "m.tar")
    uri = f"file://{archive}"
    cache = tmp_path / "cache"
    dest = cache / "abc"
    # What a fetcher that died, or something other than fetch-model, left behind.
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("half")
    (cache / ".abc.partial").mkdir()
    (cache / ".abc.partial" / "model.safetensors").write_bytes(b"\1")
    assert fetch_model_shared(uri, dest) == dest
    assert (dest / "config.json").read_text() == '{"model_type": "llama"}'
    assert (dest / DONE_MARKER).read_text() == uri
    assert sorted(p.name for p in cache.iterdir()) == ["abc", "abc.lock"]


def test_shared_a_complete_folder_is_left_as_it_is(tmp_path: Path) -> None:
    folder = make_model_folder(tmp_path / "m")
    uri = f"file://{folder}"
    dest = fetch_model_shared(uri, tmp_path / "cache" / "abc")
    (dest / "config.json").write_text("kept")
    assert fetch_model_shared(uri, dest) == dest
    assert (dest / "config.json").read_text() == "kept"


def test_shared_a_failed_fetch_puts_nothing_in_place(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "README").write_text("hi")
    with pytest.raises(FetchError, match=NEITHER):
        fetch_model_shared(f"file://{folder}", tmp_path / "cache" / "abc")
    assert not (tmp_path / "cache" / "abc").exists()
