"""Read LLMDeployment manifests from YAML as kubectl does, for `tidegate plan` and `tidegate up`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tidegate.operator.spec import API_VERSION, KIND, SpecError


class KubeYAMLLoader(yaml.SafeLoader):
    """YAML 1.2 numbers, as kubectl reads them: `70.6e9` is a float (PyYAML's 1.1 wants `70.6e+9`)."""


KubeYAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """One YAML document."""
    return yaml.load(text, Loader=KubeYAMLLoader)


def load_llm_deployments(path: str | Path) -> list[dict[str, Any]]:
    """Every LLMDeployment in a (multi-document) YAML file; other kinds are skipped."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        documents = [d for d in yaml.load_all(text, Loader=KubeYAMLLoader) if d]
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: not valid YAML: {error}") from None
    found = []
    for document in documents:
        if not isinstance(document, dict):
            raise SpecError(f"{path}: every document must be a mapping")
        if document.get("kind") != KIND:
            continue
        if document.get("apiVersion") != API_VERSION:
            raise SpecError(
                f"{path}: apiVersion {document.get('apiVersion')!r}; this operator serves "
                f"{API_VERSION}"
            )
        if not (document.get("metadata") or {}).get("name"):
            raise SpecError(f"{path}: an {KIND} needs metadata.name")
        found.append(document)
    if not found:
        raise SpecError(f"{path}: holds no {KIND} ({API_VERSION})")
    return found
