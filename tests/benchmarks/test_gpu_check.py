"""benchmarks/gpu_check.sh, the prepared GPU run: it parses, and every wheel it carries to the
device is one this environment runs (its --fetch-wheels takes their versions from here)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def carried_wheels() -> list[str]:
    match = re.search(r"^WHEELS=\(([^)]*)\)", SCRIPT.read_text(), re.MULTILINE)
    assert match, "WHEELS=(...) not found"
    return match.group(1).split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_carried_wheel_is_installed_here():
    wheels = carried_wheels()
    assert "pyzmq" in wheels and "fastapi" in wheels
    for name in wheels:
        assert importlib.metadata.version(name)


def test_what_the_server_imports_is_carried_or_on_the_image():
    # fastapi's own requirements: missing any of them on the device fails the server's import.
    requirements = importlib.metadata.requires("fastapi") or []
    names = {
        re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-")
        for r in requirements
        if "extra ==" not in r
    }
    carried = {name.lower().replace("_", "-") for name in carried_wheels()}
    on_the_image = {"anyio", "annotated-doc"}  # the device image's (its package list)
    assert names <= carried | on_the_image
