"""The host's pip configuration, handed to an image build without being baked into the image.

Where pip reaches its packages only through a mirror, a local wheel folder or a proxy with its
own certificate, a build's `pip install` fails until it is given the same settings. This reads
them (`pip config list`: files and PIP_* variables), writes them to one pip.conf that the
build mounts as a secret (images/*.Dockerfile set PIP_CONFIG_FILE to it in their build
stage only), and prints the build arguments: the secret and, for podman, a read-only volume
for each host path the settings name (certificate, constraint file, wheel folders, file://
indexes), mounted at the same path. Docker's build has no volumes: there only the settings
that are URLs carry over. Neither secrets nor volumes enter a layer, and the final stage
takes only the build stage's virtual environment.

    python3 tools/pip_build_config.py --engine podman --out .cache/images/pip.conf
    python3 tools/pip_build_config.py --cpu-torch-index    # engine-cpu's torch source
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

# The settings a build's pip needs to find and trust its packages, the way the host's pip does.
CARRIED = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "constraint")
PATH_SETTINGS = ("cert", "constraint")
LOCATION_SETTINGS = ("index-url", "extra-index-url", "find-links")
# `:env:.find-links='/opt/wheels'`, `global.cert='...'`: pip's scope, the key and its value.
LINE = re.compile(r"^(?P<scope>[^.]*)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def host_settings(python: str) -> dict[str, str]:
    """The host's effective pip settings among CARRIED; environment variables win over files,
    as they do for pip itself."""
    listing = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    from_files: dict[str, str] = {}
    from_env: dict[str, str] = {}
    for line in listing.splitlines():
        match = LINE.match(line.strip())
        if not match or match["key"] not in CARRIED:
            continue
        target = from_env if match["scope"] == ":env:" else from_files
        target[match["key"]] = match["value"]
    return from_files | from_env


def host_paths(settings: dict[str, str]) -> list[str]:
    """The existing host files and folders the settings point at."""
    paths = [settings[key] for key in PATH_SETTINGS if key in settings]
    for key in LOCATION_SETTINGS:
        for location in settings.get(key, "").split():
            url = urlparse(location)
            if url.scheme == "file" and key != "find-links":
                # A local index's pages link to files beside it (simple/ next to files/).
                paths.append(os.path.dirname(url.path.rstrip("/")))
            elif url.scheme == "file":
                paths.append(url.path)
            elif not url.scheme:
                paths.append(location)
    return sorted({p for p in paths if os.path.exists(p)})


def build_arguments(engine: str, settings: dict[str, str], config: Path) -> list[str]:
    """The secret, and the read-only volumes of the host paths where podman can mount them."""
    arguments = ["--secret", f"id=pipconf,src={config}"]
    paths = host_paths(settings)
    if engine == "podman":
        for path in paths:
            arguments += ["--volume", f"{path}:{path}:ro"]
    elif paths:
        print(
            f"docker build mounts no host paths: {', '.join(paths)} stay out of the build",
            file=sys.stderr,
        )
    return arguments


def cpu_torch_index(settings: dict[str, str]) -> list[str]:
    """engine-cpu's TORCH_INDEX, set to the host's own index when its pip has an index or wheel
    folder of its own: torch then comes from where the host's does (the Makefile's venv
    installs `torch==...` the same way, and a wheel folder's CPU build, 2.13.0+cpu, sorts above
    PyPI's 2.13.0), not from download.pytorch.org, which such a host may not reach. Nothing
    otherwise: the Dockerfile's default, PyTorch's CPU index."""
    if not any(key in settings for key in LOCATION_SETTINGS):
        return []
    return ["--build-arg", f"TORCH_INDEX={settings.get('index-url', 'https://pypi.org/simple')}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("podman", "docker"), default="podman")
    parser.add_argument("--out", type=Path, help="the pip.conf to write")
    parser.add_argument(
        "--cpu-torch-index", action="store_true", help="print engine-cpu's TORCH_INDEX argument"
    )
    parser.add_argument("--python", default=sys.executable, help="whose pip to read")
    args = parser.parse_args()
    settings = host_settings(args.python)
    if args.cpu_torch_index:
        print(" ".join(cpu_torch_index(settings)))
        return
    if args.out is None:
        parser.error("--out is needed to write the configuration")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["[global]", *(f"{key} = {value}" for key, value in sorted(settings.items()))]
    args.out.write_text("\n".join(lines) + "\n")
    print(" ".join(build_arguments(args.engine, settings, args.out.resolve())))


if __name__ == "__main__":
    main()
