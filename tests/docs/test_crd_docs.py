"""docs/crd.md, the LLMDeployment reference, is what the CRD says today.

The doc is generated from crds/llmdeployment.yaml by tools/gen_crd_docs.py; a schema change
without `python tools/gen_crd_docs.py --write` fails here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "tools" / "gen_crd_docs.py"
DOC = REPO / "docs" / "crd.md"
CRD = REPO / "crds" / "llmdeployment.yaml"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_crd_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crd_doc_is_current() -> None:
    expected = load_generator().render_crd_doc(yaml.safe_load(CRD.read_text()))
    assert DOC.read_text() == expected, (
        "docs/crd.md is out of date with crds/llmdeployment.yaml: "
        "run `python tools/gen_crd_docs.py --write`"
    )


def test_crd_doc_names_every_field_with_its_description() -> None:
    doc = DOC.read_text()
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    generator = load_generator()
    for section in ("spec", "status"):
        for path, prop, _ in generator._walk(section, schema["properties"][section], False):
            if path == section or path.endswith((">", "]")):
                continue
            assert f"| `{path}`" in doc, path
            if prop.get("description"):
                assert generator._cell(prop["description"]) in doc, path


def test_check_mode_passes_on_the_doc_as_it_is(tmp_path: Path) -> None:
    """`--check`, the command a hook or a reviewer runs, agrees, from any directory."""
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
