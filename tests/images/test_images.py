"""The container images (images/*.Dockerfile), as a cluster admin reviewing them would check.

hadolint passes at its strictest threshold; each image is multi-stage with a final stage
that takes only the build stage's virtual environment, every base is pinned to an exact
version, the user is the numeric uid the pods run as, `tidegate` is the entrypoint, there is
a HEALTHCHECK against the endpoint the process really serves, and OCI labels say what the
image is. The engine images install the pinned torch wheel before the package and its engine
extra; the operator image installs the package with its operator extra and no torch, and
everything its code path imports is in it. No container engine is needed here:
test_images_run.py builds and runs the images where podman or docker works.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from tidegate.cli import build_parser
from tidegate.cli import version as cli_version
from tidegate.engine import __version__ as engine_version
from tidegate.operator.manifest import load_llm_deployments
from tidegate.operator.render import DEFAULT_ENGINE_IMAGE, ENGINE_PORT, render

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
ENGINE_IMAGES = ("engine.Dockerfile", "engine-cpu.Dockerfile")
HADOLINT = Path(sys.executable).parent / "hadolint"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OCI_LABELS = {
    "org.opencontainers.image.title": "text",
    "org.opencontainers.image.description": "text",
    "org.opencontainers.image.version": "text",
    "org.opencontainers.image.revision": "text",
    "org.opencontainers.image.source": "url",
    "org.opencontainers.image.licenses": "spdx",
}
# The only hadolint rules an image may silence, and why.
ALLOWED_IGNORES = {
    "DL3008": "apt versions: Debian's and Ubuntu's archives drop superseded builds, so exact pins break",
}
BUILD_TOOLS = {"build-essential", "gcc", "g++", "clang", "make", "cmake", "git", "curl", "wget"}
# Final-stage build tools an image needs at run time, and why.
RUNTIME_BUILD_TOOLS = {
    "engine.Dockerfile": {
        "gcc": "Triton compiles its CUDA driver shim at run time",
        "libc6-dev": "the C library headers gcc needs for it",
        "python3.12-dev": "Python.h, which the shim includes",
    },
    "engine-cpu.Dockerfile": {
        "g++": "inductor's kernels and the CPU paged-attention kernel compile at run time",
        "libc6-dev": "the C library headers g++ needs for them",
    },
}
# Imported by no operator code path: the engine's own runtime (torch and the server).
ENGINE_ONLY = ("torch", "numpy", "fastapi", "uvicorn", "zmq", "msgspec", "safetensors")
# `pip install --no-deps "/src[extra,...]"`: the package, with these extras of pyproject.toml
# (their requirements installed by the step before, from pyproject.toml, so that a change to
# the code reuses that layer).
PACKAGE_INSTALL = re.compile(r'pip install --no-deps "/src\[([\w,-]+)\]"')
# The step before: the base requirements and those of one extra, read from pyproject.toml.
REQUIREMENTS_INSTALL = re.compile(
    r'p\["dependencies"\] \+ p\["optional-dependencies"\]\["([\w-]+)"\].*'
    r"pip install --requirement /tmp/requirements.txt"
)
# pip runs with the host's configuration mounted as a secret (tools/pip_build_config.py).
PIP_SECRET = "--mount=type=secret,id=pipconf "


@dataclass
class Stage:
    """One FROM and the instructions under it."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]
    text: str

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse(path: Path) -> Dockerfile:
    """Instructions by stage, continuation lines joined, comments dropped, global ARGs kept."""
    text = path.read_text()
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.strip().partition(" ")
        keyword, args = keyword.upper(), " ".join(args.split())
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages and keyword == "ARG":
            key, _, value = args.partition("=")
            global_args[key] = value
        elif stages:
            stages[-1].instructions.append((keyword, args))
    return Dockerfile(path, global_args, stages, text)


def resolved_base(dockerfile: Dockerfile, stage: Stage) -> str:
    """A stage's base with the global ARG defaults filled in."""
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda m: dockerfile.global_args[m.group(1) or m.group(2)],
        stage.base,
    )


def rendered_pod_security() -> dict:
    """The pod securityContext the operator renders for the CPU example."""
    resource = load_llm_deployments(REPO / "examples" / "unified-tiny.yaml")[0]
    deployment = next(o for o in render(resource).objects if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["securityContext"]


@pytest.fixture(params=DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def dockerfile(request) -> Dockerfile:
    return parse(request.param)


def test_there_are_three_images() -> None:
    assert {p.name for p in DOCKERFILES} == {*ENGINE_IMAGES, "operator.Dockerfile"}


def test_hadolint_passes_at_its_strictest(dockerfile: Dockerfile) -> None:
    labels = [f"--require-label={key}:{kind}" for key, kind in OCI_LABELS.items()]
    result = subprocess.run(
        [str(HADOLINT), "--no-color", "--failure-threshold", "style", *labels, "-"],
        input=dockerfile.text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_ignores_are_few_and_explained(dockerfile: Dockerfile) -> None:
    lines = dockerfile.text.splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"#\s*hadolint\s+ignore=(\S+)", line.strip())
        if not match:
            continue
        rules = set(match.group(1).split(","))
        assert rules <= set(ALLOWED_IGNORES), f"line {number + 1}: {rules - set(ALLOWED_IGNORES)}"
        above = lines[number - 1].strip() if number else ""
        assert above.startswith("#") and len(above) > 20, f"line {number + 1}: say why above"


def test_multi_stage_and_the_final_stage_takes_only_the_build(dockerfile: Dockerfile) -> None:
    assert len(dockerfile.stages) >= 2
    build_names = {stage.name for stage in dockerfile.stages[:-1]}
    for copy in dockerfile.final.all("COPY"):
        source = re.search(r"--from=(\S+)", copy)
        assert source and source.group(1) in build_names, f"final stage copies {copy!r}"


def test_no_build_tools_in_the_final_stage(dockerfile: Dockerfile) -> None:
    allowed = RUNTIME_BUILD_TOOLS.get(dockerfile.path.name, {})
    for run in dockerfile.final.all("RUN"):
        installed = re.findall(r"install\s+-y\s+--no-install-recommends\s+([^&;]+)", run)
        for package in " ".join(installed).split():
            if package in BUILD_TOOLS or package.endswith("-dev"):
                assert package in allowed, f"{package} in the final stage"
        assert "pip install" not in run, "the final stage copies the venv, it builds nothing"
    for package, reason in allowed.items():
        assert package in dockerfile.text, package
        assert reason


def test_every_base_is_pinned_to_an_exact_version(dockerfile: Dockerfile) -> None:
    names = set()
    for stage in dockerfile.stages:
        base = resolved_base(dockerfile, stage)
        if base in names:  # an earlier stage
            continue
        if "@sha256:" not in base:
            image, _, tag = base.rpartition(":")
            assert image and "/" not in tag, f"{base}: no tag"
            assert tag != "latest" and re.match(r"\d+\.\d+\.\d+", tag), f"{base}: not exact"
        names.add(stage.name)


def test_runs_as_the_numeric_non_root_user_its_pods_run_as(dockerfile: Dockerfile) -> None:
    user = dockerfile.final.all("USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER {user}: numeric, so runAsNonRoot can check"
    assert gid.isdigit() and int(gid) > 0
    if dockerfile.path.name in ENGINE_IMAGES:
        pod = rendered_pod_security()
        assert (int(uid), int(gid)) == (pod["runAsUser"], pod["runAsGroup"])
    else:
        values = REPO / "charts" / "tidegate" / "values.yaml"
        if values.exists():
            context = yaml.safe_load(values.read_text())["securityContext"]
            assert (int(uid), int(gid)) == (context["runAsUser"], context["runAsGroup"])
    env = " ".join(dockerfile.final.all("ENV"))
    assert "HOME=/tmp" in env, "pods run with a read-only root and HOME=/tmp"


def test_entrypoint_is_tidegate(dockerfile: Dockerfile) -> None:
    assert [json.loads(e) for e in dockerfile.final.all("ENTRYPOINT")] == [["tidegate"]]
    command = json.loads(dockerfile.final.all("CMD")[-1])
    build_parser().parse_args(command)  # a command line the CLI accepts


def test_healthcheck_calls_what_the_process_serves(dockerfile: Dockerfile) -> None:
    (check,) = dockerfile.final.all("HEALTHCHECK")
    exec_form = json.loads(check[check.index("CMD") + 3 :])
    assert exec_form[:2] == ["python", "-c"], "no curl or shell in the images"
    (url,) = re.findall(r"http://[^'\"]+", exec_form[2])
    if dockerfile.path.name in ENGINE_IMAGES:
        assert url == f"http://127.0.0.1:{ENGINE_PORT}/health"
    else:
        liveness = build_parser().parse_args(["operator"]).liveness
        assert url == liveness.replace("0.0.0.0", "127.0.0.1")
    assert "--start-period=" in check


def test_oci_labels(dockerfile: Dockerfile) -> None:
    labels = dict(
        item.split("=", 1) for label in dockerfile.final.all("LABEL") for item in shlex.split(label)
    )
    assert set(OCI_LABELS) <= set(labels)
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]
    args = dict(a.partition("=")[::2] for a in dockerfile.final.all("ARG"))
    assert args["VERSION"] == PYPROJECT["project"]["version"]


@pytest.mark.parametrize("name", ENGINE_IMAGES)
def test_engine_images_pin_torch_before_the_package(name: str) -> None:
    build = parse(IMAGES / name).stages[0]
    runs = build.all("RUN")
    torch_run = next(i for i, run in enumerate(runs) if "torch==" in run)
    requirements_run = next(i for i, run in enumerate(runs) if REQUIREMENTS_INSTALL.search(run))
    package_run = next(i for i, run in enumerate(runs) if PACKAGE_INSTALL.search(run))
    assert torch_run < requirements_run < package_run
    assert REQUIREMENTS_INSTALL.search(runs[requirements_run]).group(1) == "engine"
    assert PACKAGE_INSTALL.search(runs[package_run]).group(1).split(",") == ["engine"]
    args = dict(a.partition("=")[::2] for a in build.all("ARG"))
    makefile = (REPO / "Makefile").read_text()
    assert f"torch=={args['TORCH_VERSION']}" in makefile, "the version the tests run"
    index = {"engine-cpu.Dockerfile": r"/whl/cpu$", "engine.Dockerfile": r"/whl/cu\d+$"}[name]
    assert re.search(index, args["TORCH_INDEX"]), args["TORCH_INDEX"]


def operator_extras() -> list[str]:
    """The extras the operator image installs the package with: its two pip commands, the
    requirements of the base and one extra, then the package with that extra."""
    runs = [r for r in parse(IMAGES / "operator.Dockerfile").stages[0].all("RUN") if "pip" in r]
    assert len(runs) == 2, runs
    requirements = REQUIREMENTS_INSTALL.search(runs[0])
    package = PACKAGE_INSTALL.fullmatch(runs[1].removeprefix(PIP_SECRET))
    assert requirements and package, f"the operator image installs the package only: {runs}"
    assert [requirements.group(1)] == package.group(1).split(",")
    return package.group(1).split(",")


def operator_requirements() -> list[Requirement]:
    """pyproject's base dependencies and those of the operator image's extras."""
    project = PYPROJECT["project"]
    extras = [s for extra in operator_extras() for s in project["optional-dependencies"][extra]]
    return [Requirement(spec) for spec in project["dependencies"] + extras]


def test_operator_image_installs_the_operator_extra_and_no_engine_one() -> None:
    assert operator_extras() == ["operator"]
    engine = {
        Requirement(spec).name for spec in PYPROJECT["project"]["optional-dependencies"]["engine"]
    }
    assert "torch" in engine
    # Both serve Prometheus /metrics (the engine's server, the operator's autoscaler), and both
    # speak CURVE (the engine's KV channels; the operator makes each deployment's key pair):
    # those two are the requirements they may share.
    shared = {"prometheus-client", "pyzmq"}
    assert engine & {r.name for r in operator_requirements()} <= shared


def closure(names: list[str]) -> set[str]:
    """The distributions these need, with everything they need in turn."""
    seen: set[str] = set()
    todo = [name.lower() for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name.lower())
    return {name.replace("_", "-") for name in seen}


def image_site_packages(root: Path, distributions: set[str]) -> Path:
    """A folder holding just these distributions (links into ours) and tidegate."""
    site = root / "site-packages"
    (site / "tidegate").mkdir(parents=True)
    for package in ("cli", "common", "engine", "operator"):
        (site / "tidegate" / package).symlink_to(REPO / package)
    for name in distributions - {"tidegate"}:
        dist = metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (site / top).exists():
                (site / top).symlink_to(Path(str(dist.locate_file(top))))
    return site


# `tidegate operator`'s and `tidegate plan`'s imports, and a whole `tidegate plan`.
OPERATOR_CODE_PATH = f"""
import contextlib, io, json, sys
import tidegate.operator.handlers
from tidegate.cli import build_parser, main

build_parser(only=["operator"]).parse_args(["operator"])
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["plan", "-f", {str(REPO / "examples" / "llama-70b-8gpu.yaml")!r}]) == 0
print(json.dumps(sorted(sys.modules)))
"""


def test_operator_image_holds_everything_the_operator_imports(tmp_path: Path) -> None:
    """`tidegate operator` and `tidegate plan` need no torch, nothing the image lacks.

    Python runs without its site-packages (-S), on a folder of only the distributions the
    operator image installs: an optional import of anything else fails quietly, as in the
    image, and a needed one fails the test.
    """
    installed = closure([r.name for r in operator_requirements()]) | {"tidegate"}
    assert not installed & set(ENGINE_ONLY), installed & set(ENGINE_ONLY)
    site = image_site_packages(tmp_path, installed)
    result = subprocess.run(
        [sys.executable, "-S", "-c", OPERATOR_CODE_PATH],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository root: its operator/ would shadow the stdlib module
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    modules = {name.partition(".")[0] for name in json.loads(result.stdout)}
    assert "kopf" in modules and not modules & set(ENGINE_ONLY)


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = re.escape(pattern.lstrip("!").rstrip("/"))
        regex = regex.replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = regex.replace(r"\[", "[").replace(r"\]", "]")
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def test_build_context_holds_what_pip_reads_and_nothing_heavy() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = {
        word
        for path in DOCKERFILES
        for stage in parse(path).stages
        for copy in stage.all("COPY")
        if "--from=" not in copy
        for word in copy.split()[:-1]
    }
    assert PYPROJECT["project"]["readme"] in sources
    for source in sources:
        root = REPO / source
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        kept = [f for f in files if "__pycache__" not in f.parts]
        assert kept, source
        for file in kept:
            assert not dockerignore_excludes(file.relative_to(REPO).as_posix(), patterns), file
    for heavy in (".git", ".venv", ".cache", "tests", "benchmarks", "charts", "tidegate.egg-info"):
        assert dockerignore_excludes(f"{heavy}/anything", patterns), heavy
    assert dockerignore_excludes("engine/core/__pycache__/x.pyc", patterns)


@pytest.mark.parametrize("name", [p.name for p in DOCKERFILES])
def test_every_pip_run_gets_the_host_configuration_as_a_secret(name: str) -> None:
    """The build's pip reads PIP_CONFIG_FILE from the secret mount, so the configuration
    (which may name a mirror with credentials) never lands in a layer, and only the build
    stage, which the final one leaves behind, sees it."""
    dockerfile = parse(IMAGES / name)
    build = dockerfile.stages[0]
    env = " ".join(build.all("ENV"))
    assert "PIP_CONFIG_FILE=/run/secrets/pipconf" in env
    for run in build.all("RUN"):
        if "pip install" in run:
            assert run.startswith(PIP_SECRET), run
    assert "PIP_CONFIG_FILE" not in " ".join(dockerfile.final.all("ENV"))


def test_one_version_for_the_package_the_chart_and_the_images(capsys) -> None:
    """pyproject.toml's version is the release: `tidegate --version` prints it (from the
    installed metadata), the chart's appVersion repeats it, make tags the images with it and
    passes it to their labels, and the examples and the operator's default name those tags."""
    version = PYPROJECT["project"]["version"]
    assert cli_version() == version, "reinstall: pip install -e ."
    with pytest.raises(SystemExit):
        build_parser(only=[]).parse_args(["--version"])
    assert capsys.readouterr().out == f"tidegate {version}\n"
    chart = yaml.safe_load((REPO / "charts" / "tidegate" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^VERSION := .*pyproject\.toml", makefile, re.MULTILINE)
    assert re.search(r"^IMAGE_TAG \?= \$\(VERSION\)$", makefile, re.MULTILINE)
    assert "--build-arg VERSION=$(VERSION)" in makefile
    assert DEFAULT_ENGINE_IMAGE.rpartition(":")[2] == version
    assert engine_version == version
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for image in re.findall(r"image: (ghcr\.io/tidegate/\S+)", example.read_text()):
            assert image.rpartition(":")[2] == version, (example.name, image)


def test_make_images_builds_all_three() -> None:
    makefile = (REPO / "Makefile").read_text()
    target = makefile[makefile.index("\nimages:") :]
    for path in DOCKERFILES:
        assert f"image-{path.name.removesuffix('.Dockerfile')}" in target, path.name
    assert "-f images/$*.Dockerfile" in target
    assert re.search(r"^\.PHONY:.*\bimages\b", makefile, re.MULTILINE)
