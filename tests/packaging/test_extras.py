"""What each install brings: the base install runs the light commands, and a command whose
extra is missing ends with one line that names it.

An install without an extra is imitated in a subprocess by blocking the modules of that
extra's distributions (None in sys.modules: importing them raises ModuleNotFoundError, as
when they are not installed).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tidegate.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
RUNTIME_EXTRAS = ("engine", "operator", "bench")

# `tidegate ARGS...` with the modules named in argv[1] (comma-separated) blocked.
TIDEGATE_WITHOUT = """
import sys
for name in filter(None, sys.argv[1].split(",")):
    sys.modules[name] = None
from tidegate.cli import main
sys.exit(main(sys.argv[2:]))
"""


def modules_of(*extras: str) -> set[str]:
    """The top-level modules of the distributions these extras add to the base install."""
    base = {canonicalize_name(Requirement(s).name) for s in PYPROJECT["project"]["dependencies"]}
    added = {canonicalize_name(Requirement(s).name) for e in extras for s in EXTRAS[e]} - base
    return {
        module
        for module, distributions in metadata.packages_distributions().items()
        if {canonicalize_name(d) for d in distributions} & added
    }


def tidegate_without(blocked: set[str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", TIDEGATE_WITHOUT, ",".join(sorted(blocked)), *args],
        capture_output=True,
        text=True,
        cwd=cwd,  # not the repository root: its operator/ would shadow the stdlib module
        timeout=120,
    )


def test_every_extra_a_command_names_is_in_pyproject() -> None:
    for name, command in COMMANDS.items():
        assert set(command.extras) <= set(RUNTIME_EXTRAS), name
    assert set(RUNTIME_EXTRAS) <= set(EXTRAS)


def test_the_base_install_runs_help_plan_and_fetch_model(tmp_path: Path) -> None:
    blocked = modules_of(*RUNTIME_EXTRAS)
    assert {"torch", "fastapi", "uvicorn", "zmq", "kopf", "aiohttp", "httpx"} <= blocked
    result = tidegate_without(blocked, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in COMMANDS)
    manifest = REPO / "examples" / "llama-70b-8gpu.yaml"
    result = tidegate_without(blocked, "plan", "-f", str(manifest), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Deployment" in result.stdout
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    result = tidegate_without(
        blocked, "fetch-model", source.as_uri(), str(tmp_path / "fetched"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "fetched" / "config.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("args", "extra", "install"),
    [
        (("make-tiny-model", "DIR"), "engine", "tidegate[engine]"),
        (("serve", "--model", "DIR"), "engine", "tidegate[engine]"),
        (("operator",), "operator", "tidegate[operator]"),
        (("bench", "serve", "--help"), "bench", "tidegate[bench,engine]"),
    ],
    ids=["make-tiny-model", "serve", "operator", "bench"],
)
def test_a_missing_extra_is_named_in_one_line(
    tmp_path: Path, args: tuple[str, ...], extra: str, install: str
) -> None:
    args = tuple(str(tmp_path / "model") if a == "DIR" else a for a in args)
    result = tidegate_without(modules_of(extra), *args, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"tidegate {args[0]} needs the ") and f"'{install}'" in line, line
