"""A Secret volume as the kubelet lays it out, for tests that change one under a reader."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path


class SecretVolume:
    """A folder like a mounted Secret: `<name> -> ..data/<name>`, `..data -> ..<timestamp>`.

    `write` changes it as the kubelet's atomic writer does: the new content goes into a new
    timestamped folder, a `..data_tmp` link to that folder replaces `..data` in one rename,
    and the old folder is removed. A reader sees the old file or the new one, never a mix;
    `<name>` itself never changes, so only its content tells that anything did.
    """

    def __init__(self, directory: Path, name: str = "api-key") -> None:
        self.directory = directory
        self.name = name

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def write(self, content: str | bytes) -> None:
        stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
        folder = Path(tempfile.mkdtemp(prefix=stamp, dir=self.directory))
        file = folder / self.name
        if isinstance(content, bytes):
            file.write_bytes(content)
        else:
            file.write_text(content, encoding="utf-8")
        data = self.directory / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        swap = self.directory / "..data_tmp"
        os.symlink(folder.name, swap)
        os.rename(swap, data)
        if not self.path.is_symlink():
            os.symlink(f"..data/{self.name}", self.path)
        if old is not None:
            shutil.rmtree(self.directory / old)
