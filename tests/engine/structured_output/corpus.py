"""The corpus of constraints (tests/fixtures/structured/schemas.json) and the backends' names."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "structured" / "schemas.json").read_text()
)
BACKENDS = ("xgrammar", "guidance")
