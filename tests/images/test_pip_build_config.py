"""tools/pip_build_config.py: the host's pip settings become one pip.conf (a build secret) and,
for podman, read-only mounts of the host paths they name; nothing else of the host goes in."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location(
    "pip_build_config", REPO / "tools" / "pip_build_config.py"
)
pip_build_config = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(pip_build_config)


def test_local_indexes_wheel_folders_and_files_are_mounted_where_the_settings_say(
    tmp_path: Path,
) -> None:
    index = tmp_path / "pypi" / "simple"
    wheels = tmp_path / "wheels"
    cert = tmp_path / "ca.pem"
    for folder in (index, wheels):
        folder.mkdir(parents=True)
    cert.write_text("certificate")
    settings = {
        "extra-index-url": f"file://{index} https://mirror.example/simple",
        "find-links": str(wheels),
        "cert": str(cert),
        "constraint": str(tmp_path / "absent.txt"),  # named but missing: not mounted
    }
    config = tmp_path / "pip.conf"
    arguments = pip_build_config.build_arguments("podman", settings, config)
    assert arguments[:2] == ["--secret", f"id=pipconf,src={config}"]
    volumes = {arguments[i + 1] for i, word in enumerate(arguments) if word == "--volume"}
    # An index's pages link to the files beside it: its parent is mounted.
    assert volumes == {f"{p}:{p}:ro" for p in (index.parent, wheels, cert)}
    # With an index or wheel folder of its own, the host's pip also decides where engine-cpu's
    # torch comes from.
    assert pip_build_config.cpu_torch_index(settings) == [
        "--build-arg",
        "TORCH_INDEX=https://pypi.org/simple",
    ]


def test_docker_gets_the_secret_only_and_a_plain_host_changes_nothing(tmp_path: Path) -> None:
    config = tmp_path / "pip.conf"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    docker = pip_build_config.build_arguments("docker", {"find-links": str(wheels)}, config)
    assert "--volume" not in docker
    plain = pip_build_config.build_arguments("podman", {}, config)
    assert plain == ["--secret", f"id=pipconf,src={config}"]
    assert pip_build_config.cpu_torch_index({}) == []  # the Dockerfile's CPU index
