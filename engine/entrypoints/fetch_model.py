"""`tidegate fetch-model URI DIR`: put a model or adapter folder where a pod expects it.

The URI names a .tar, .tar.gz or .tgz of a Hugging Face model folder (config.json at its top)
or of a LoRA adapter folder (PEFT's adapter_config.json), over http(s) or as a file:// path
(a file:// directory is copied). A finished fetch leaves a marker, so a restarted
init container does nothing; an interrupted one starts over. Archive members that would land
outside DIR (absolute paths, `..`, links out) are refused.

With `--shared`, DIR is a folder of a cache that other pods fill too (a node's disk, a
ReadWriteMany claim): fetchers of one DIR take a lock on `DIR.lock` beside it, the first fills
`.DIR.partial` and renames it to DIR with the marker already inside, and the others wait on
the lock, then find DIR complete and download nothing. A fetcher that dies leaves at most a
partial folder, which the next one clears; the kernel releases its lock.
"""

from __future__ import annotations

import fcntl
import shutil
import tarfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DONE_MARKER = ".tidegate-fetched"
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
# What marks a folder as one the engine can serve: a model's config, or a LoRA adapter's
# (spec.adapters' uri sources are fetched by this command too). Names, not the engine's
# constants: fetch-model runs from the base install, which has no torch to import them with.
FOLDER_MARKERS = ("config.json", "adapter_config.json")


class FetchError(ValueError):
    """A URI that cannot be fetched; the message says what is accepted."""


def fetch_model(uri: str, dest: str | Path, timeout_s: float = 60.0) -> Path:
    """Fetch `uri` into `dest` unless an earlier fetch of the same URI finished there."""
    dest = Path(dest)
    if is_complete(dest, uri):
        return dest
    _check_uri(uri)
    dest.mkdir(parents=True, exist_ok=True)
    # dest is often a mount point (an emptyDir), so it is filled in place.
    _clear(dest)
    _fill(uri, dest, timeout_s)
    return dest


def fetch_model_shared(uri: str, dest: str | Path, timeout_s: float = 60.0) -> Path:
    """Fetch `uri` into `dest` of a shared cache: once, under a lock, renamed into place whole."""
    dest = Path(dest)
    if is_complete(dest, uri):  # dest appears whole, marker included: no lock needed to see it
        return dest
    _check_uri(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with lock_beside(dest):
        if is_complete(dest, uri):  # another pod filled it while this one waited
            return dest
        partial = dest.parent / f".{dest.name}.partial"
        _remove(partial)  # left by a fetcher that died
        partial.mkdir()
        _fill(uri, partial, timeout_s)
        # Only a folder without this URI's marker is here: a half one from elsewhere, or
        # another URI's. Moved aside first, since a folder cannot be renamed over a full one.
        stale = dest.parent / f".{dest.name}.stale"
        _remove(stale)
        if dest.exists():
            dest.rename(stale)
        partial.rename(dest)
        _remove(stale)
    return dest


def is_complete(dest: Path, uri: str) -> bool:
    """Whether a fetch of `uri` finished in `dest`: its marker decides, not what else is there."""
    marker = dest / DONE_MARKER
    return marker.is_file() and marker.read_text() == uri


@contextmanager
def lock_beside(dest: Path) -> Iterator[None]:
    """An exclusive lock on `<dest>.lock`, held until the block ends or the process dies.

    POSIX (fcntl) locks rather than flock: NFS, which most ReadWriteMany claims are, carries
    them to its server, so pods on different nodes exclude each other too.
    """
    with (dest.parent / f"{dest.name}.lock").open("a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)  # blocks while another fetcher holds it
        yield  # closing the file releases the lock


def _check_uri(uri: str) -> None:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https", "file"):
        raise FetchError(f"unsupported URI scheme {parsed.scheme!r}: use http, https or file")
    is_folder = parsed.scheme == "file" and Path(parsed.path).is_dir()
    if not is_folder and not parsed.path.endswith(_ARCHIVE_SUFFIXES):
        raise FetchError(f"{uri} is not a .tar, .tar.gz or .tgz archive nor a directory")


def _fill(uri: str, folder: Path, timeout_s: float) -> None:
    """Put the model of `uri` into the empty `folder`, and its marker last."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file" and Path(parsed.path).is_dir():
        shutil.copytree(parsed.path, folder, dirs_exist_ok=True)
    else:
        # The archive goes on the same volume as the model: /tmp may be too small for weights
        # (and the folder is often a mount point, so nothing can be put beside it).
        archive = folder / ".tidegate-download"
        try:
            with (
                urllib.request.urlopen(uri, timeout=timeout_s) as response,
                archive.open("wb") as f,
            ):
                shutil.copyfileobj(response, f, length=1 << 20)
            _extract(archive, folder)
        finally:
            archive.unlink(missing_ok=True)
        _lift_single_folder(folder)
    if not _is_servable(folder):
        raise FetchError(
            f"{uri} holds neither config.json nor adapter_config.json at its top level: "
            "not a model folder nor a LoRA adapter folder"
        )
    (folder / DONE_MARKER).write_text(uri)


def _is_servable(folder: Path) -> bool:
    """Whether `folder` is a model's or a LoRA adapter's: its marker file is at the top."""
    return any((folder / name).is_file() for name in FOLDER_MARKERS)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _clear(dest: Path) -> None:
    for entry in dest.iterdir():
        _remove(entry)


def _extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        try:
            # The "data" filter refuses absolute names, `..`, links out of dest and devices.
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as error:
            raise FetchError(f"refused archive member: {error}") from None


def _lift_single_folder(dest: Path) -> None:
    # An archive of `name/…` rather than of the folder's contents: lift the one folder up.
    entries = list(dest.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not _is_servable(dest):
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(dest / child.name)
        inner.rmdir()
