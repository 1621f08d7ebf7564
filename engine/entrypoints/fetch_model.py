"""`tidegate fetch-model URI DIR`: put a model folder where a pod expects it (init container).

The URI names a .tar, .tar.gz or .tgz of a Hugging Face model folder, over http(s) or as a
file:// path (a file:// directory is copied). A finished fetch leaves a marker, so a restarted
init container does nothing; an interrupted one starts over. Archive members that would land
outside DIR (absolute paths, `..`, links out) are refused.
"""

from __future__ import annotations

import shutil
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

DONE_MARKER = ".tidegate-fetched"
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class FetchError(ValueError):
    """A URI that cannot be fetched; the message says what is accepted."""


def fetch_model(uri: str, dest: str | Path, timeout_s: float = 60.0) -> Path:
    """Fetch `uri` into `dest` unless an earlier fetch of the same URI finished there."""
    dest = Path(dest)
    marker = dest / DONE_MARKER
    if marker.exists() and marker.read_text() == uri:
        return dest
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https", "file"):
        raise FetchError(f"unsupported URI scheme {parsed.scheme!r}: use http, https or file")
    dest.mkdir(parents=True, exist_ok=True)
    _clear(dest)
    if parsed.scheme == "file" and Path(parsed.path).is_dir():
        shutil.copytree(parsed.path, dest, dirs_exist_ok=True)
    else:
        if not parsed.path.endswith(_ARCHIVE_SUFFIXES):
            raise FetchError(f"{uri} is not a .tar, .tar.gz or .tgz archive nor a directory")
        # The archive goes on the same volume as the model: /tmp may be too small for weights.
        # (and dest is often a mount point, so nothing can be put beside it).
        archive = dest / ".tidegate-download"
        try:
            with (
                urllib.request.urlopen(uri, timeout=timeout_s) as response,
                archive.open("wb") as f,
            ):
                shutil.copyfileobj(response, f, length=1 << 20)
            _extract(archive, dest)
        finally:
            archive.unlink(missing_ok=True)
        _lift_single_folder(dest)
    if not (dest / "config.json").exists():
        raise FetchError(f"{uri} holds no config.json at its top level: not a model folder")
    marker.write_text(uri)
    return dest


def _clear(dest: Path) -> None:
    for entry in dest.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


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
    if len(entries) == 1 and entries[0].is_dir() and not (dest / "config.json").exists():
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(dest / child.name)
        inner.rmdir()
