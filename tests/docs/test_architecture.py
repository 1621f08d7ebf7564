"""docs/architecture.md names only what exists, the README links to it, and the repository
refers to nothing outside itself.

The architecture document cites modules by repository path (`engine/core/scheduler.py`,
`operator/`) and by import name (`tidegate.engine.core`). A rename that forgets the document
fails here, with every stale name listed.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
README = REPO / "README.md"
# Import name -> folder, as pyproject maps them (tidegate.engine -> engine, ...).
PACKAGE_DIRS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]

# A backticked span is a repository path when it starts with one of these folders, or is one of
# these files, or contains a '/' and ends like a file. Anything else in backticks (flags, CRD
# fields such as `nvidia.com/gpu`, URLs, `/etc/...` paths inside a pod) is left alone.
TOP_LEVEL_FOLDERS = frozenset(
    {
        "benchmarks",
        "charts",
        "cli",
        "common",
        "crds",
        "docs",
        "engine",
        "examples",
        "images",
        "operator",
        "tests",
        "tools",
    }
)
ROOT_FILES = frozenset({"Makefile", "README.md", "pyproject.toml", ".importlinter"})
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".tpl", ".Dockerfile")

# A code span may run over a line break, as Markdown allows; its whitespace is then one space.
_CODE_SPAN = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_PATH = re.compile(r"[A-Za-z0-9_.*-]+(/[A-Za-z0-9_.*-]+)*/?")
_MODULE = re.compile(r"tidegate(\.[A-Za-z_][A-Za-z0-9_]*)+")


def code_spans(markdown: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return [" ".join(span.split()) for span in _CODE_SPAN.findall(_FENCE.sub("", markdown))]


def looks_like_path(span: str) -> bool:
    """Whether a code span names a file or folder of the repository."""
    if not _PATH.fullmatch(span) or span.startswith("/"):
        return False
    first = span.split("/", 1)[0]
    if first in TOP_LEVEL_FOLDERS:
        return "/" in span
    if span in ROOT_FILES:
        return True
    return "/" in span and span.endswith(FILE_SUFFIXES)


def cited_paths(markdown: str) -> list[str]:
    return sorted({span for span in code_spans(markdown) if looks_like_path(span)})


def cited_modules(markdown: str) -> list[str]:
    return sorted({span for span in code_spans(markdown) if _MODULE.fullmatch(span)})


def path_exists(path: str) -> bool:
    """A path relative to the repository root; a trailing '/' asks for a folder, '*' globs."""
    if "*" in path:
        return any(REPO.glob(path.rstrip("/")))
    target = REPO / path.rstrip("/")
    return target.is_dir() if path.endswith("/") else target.exists()


def module_exists(name: str) -> bool:
    """An import name, mapped through pyproject's package-dir, else found by importlib."""
    for package, folder in PACKAGE_DIRS.items():
        if name == package or name.startswith(package + "."):
            rest = name[len(package) :].lstrip(".").split(".") if name != package else []
            base = REPO / folder / Path(*rest) if rest else REPO / folder
            if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_the_document_cites_modules() -> None:
    text = DOC.read_text()
    # Guards the extraction itself: a broken pattern would make the checks below vacuous.
    assert len(cited_paths(text)) >= 50
    assert len(cited_modules(text)) >= 10
    assert "engine/core/scheduler.py" in cited_paths(text)
    assert "tidegate.engine.core" in cited_modules(text)


def test_every_cited_path_exists() -> None:
    missing = [path for path in cited_paths(DOC.read_text()) if not path_exists(path)]
    assert not missing, f"docs/architecture.md cites paths that do not exist: {missing}"


def test_every_cited_module_exists() -> None:
    missing = [name for name in cited_modules(DOC.read_text()) if not module_exists(name)]
    assert not missing, f"docs/architecture.md cites modules that do not exist: {missing}"


def test_the_readme_links_to_the_architecture() -> None:
    assert re.search(r"\]\(docs/architecture\.md\)", README.read_text()), (
        "README.md must link to docs/architecture.md"
    )


def test_nothing_refers_outside_the_repository() -> None:
    # Built from parts, so that this file does not match its own pattern.
    pattern = "|".join(["\\.\\." + "/shared", "/work" + "/shared"])
    try:
        found = subprocess.run(
            ["git", "grep", "-n", "-I", "--untracked", "-E", pattern],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if found.returncode not in (0, 1):
        pytest.skip(f"not a git checkout: {found.stderr.strip()}")
    assert found.returncode == 1, (
        "files refer to a folder outside the repository, which a clone does not have:\n"
        + found.stdout
    )
