"""The wheel, as a user installs it: built without warnings, holding every source file and the
package data, and working from a fresh environment outside the repository.

The wheel is built from a copy of what pyproject.toml reads, so the build leaves no build/ or
egg-info in the working tree. The fresh venv gets the wheel with --no-deps and sees the
third-party packages already installed here through a plain path in a .pth file: a plain path
does not run that folder's own .pth files, so the repository's editable install stays out and
`import tidegate` can only find the wheel's copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tidegate.common.local_server import LocalServer, free_port

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]  # "tidegate.engine" -> "engine"
PIP = [sys.executable, "-m", "pip"]


def source_files() -> set[str]:
    """Every file the wheel must hold, as its path inside the wheel."""
    files = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                inside = path.relative_to(REPO / folder).as_posix()
                files.add(f"{package.replace('.', '/')}/{inside}")
    return files


def test_every_source_folder_is_a_listed_package() -> None:
    listed = set(SETUPTOOLS["packages"])
    for package, folder in PACKAGE_DIRS.items():
        for path in [REPO / folder, *(REPO / folder).rglob("*")]:
            if path.is_dir() and path.name != "__pycache__" and any(path.glob("*.*")):
                parts = path.relative_to(REPO / folder).parts
                assert ".".join((package, *parts)) in listed, f"{path} is missing from packages"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, and what `pip wheel` printed while building it."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        shutil.copy(REPO / name, source / name)
    for folder in PACKAGE_DIRS.values():
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    build = ["wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run(
        [*PIP, *build, "--wheel-dir", str(root / "dist"), str(source)],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (root / "dist").glob("tidegate-*.whl")
    return wheel, result.stdout + result.stderr


@pytest.fixture(scope="module")
def venv(built: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, and this one's third-party packages as a plain path."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    (site / "dependencies_of_the_tests.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = ["install", "--quiet", "--no-deps", "--no-index", str(built[0])]
    subprocess.run(
        [*PIP, "--python", str(root / "bin" / "python"), *install],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        timeout=300,
    )
    return root


@pytest.mark.slow
def test_the_wheel_builds_without_warnings_and_holds_every_file(built: tuple[Path, str]) -> None:
    wheel, output = built
    assert "warning" not in output.lower(), output
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "tidegate/engine/data/tiny_corpus.txt" in names
    packaged = {name for name in names if name.startswith("tidegate/")}
    assert packaged == source_files(), sorted(packaged ^ source_files())
    (metadata,) = {name.partition("/")[0] for name in names - packaged}
    assert metadata.endswith(".dist-info"), metadata


@pytest.mark.slow
def test_the_installed_wheel_serves_from_outside_the_repository(
    venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("TIDEGATE_COMPILATION_LEVEL", "0")  # eager: starts in about 2 s
    monkeypatch.setenv("PATH", f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    tidegate = str(venv / "bin" / "tidegate")

    def run(*command: str) -> subprocess.CompletedProcess:
        result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    where = (
        "import json, sys, tidegate.engine as e; print(json.dumps([e.__file__, [*sys.modules]]))"
    )
    engine_file, modules = json.loads(run(str(venv / "bin" / "python"), "-c", where).stdout)
    assert Path(engine_file).is_relative_to(venv), engine_file
    assert not [m for m in modules if m.startswith("__editable__")]

    assert "serve" in run(tidegate, "--help").stdout
    model = tmp_path / "model"
    run(tidegate, "make-tiny-model", str(model))
    port = free_port()
    command = [tidegate, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    with LocalServer(command, port, log=tmp_path / "serve.log", cwd=tmp_path) as server:
        server.wait_healthy(deadline_s=60)
        with urllib.request.urlopen(server.base_url + "/v1/models", timeout=10) as response:
            name = json.load(response)["data"][0]["id"]
        body = {"model": name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            server.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 4, answer
        assert answer["choices"][0]["finish_reason"] == "length"
        assert isinstance(answer["choices"][0]["text"], str)
        assert server.stop() == 0, server.log()
