"""Every third-party module Tidegate's code imports is declared in pyproject.toml.

An import that only works because something else happened to install the module passes every
test here and fails on a user's clean install (or in an image that installs one extra). So
each module under cli/, common/, engine/ and operator/ is parsed, imports inside functions
included, and the distribution of every third-party module it names must appear in
pyproject's dependencies or one of its extras.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SOURCE_FOLDERS = sorted(set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()))


def imported_top_level_modules(path: Path) -> set[str]:
    """The top-level names of every absolute import in the file, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def third_party_imports() -> dict[str, set[str]]:
    """Third-party top-level module -> the source files that import it."""
    found: dict[str, set[str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for name in imported_top_level_modules(path):
                if name in sys.stdlib_module_names or name == "tidegate":
                    continue
                found.setdefault(name, set()).add(path.relative_to(REPO).as_posix())
    return found


def declared_distributions() -> set[str]:
    """Every distribution named in dependencies or in any extra, canonicalized."""
    project = PYPROJECT["project"]
    specs = project["dependencies"] + [
        spec for extra in project["optional-dependencies"].values() for spec in extra
    ]
    return {canonicalize_name(Requirement(spec).name) for spec in specs}


def test_the_scan_sees_the_imports_it_must() -> None:
    imports = third_party_imports()
    assert "operator/kube.py" in imports["aiohttp"]  # a top-level import
    assert "engine/bench/serve.py" in imports["tqdm"]  # an import inside a function
    assert not {"json", "asyncio", "tidegate"} & set(imports)


def test_every_third_party_import_is_declared() -> None:
    distributions = metadata.packages_distributions()
    declared = declared_distributions()
    undeclared = []
    for module, files in sorted(third_party_imports().items()):
        providers = {canonicalize_name(d) for d in distributions.get(module, [])}
        assert providers, f"{module} (imported by {sorted(files)}) is not installed here"
        if not providers & declared:
            undeclared.append(f"{module} ({' or '.join(sorted(providers))}): {sorted(files)}")
    assert not undeclared, "imported but not in pyproject.toml:\n" + "\n".join(undeclared)
