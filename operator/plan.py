"""`tidegate plan -f FILE`: what the operator would create for a manifest, and why; no cluster."""

from __future__ import annotations

from typing import Any, TextIO

import yaml

from tidegate.operator.render import Rendered, RenderOptions, render
from tidegate.operator.tuning import Tuning


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the engine config files) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def plan(resources: list[dict[str, Any]], options: RenderOptions) -> list[Rendered]:
    """Render each resource; SpecError/TuningError propagate with the user's message."""
    return [render(resource, options) for resource in resources]


def write_yaml(resources: list[dict[str, Any]], plans: list[Rendered], out: TextIO) -> None:
    """Every object as a multi-document YAML stream, ready for `kubectl apply -f -`."""
    for resource, rendered in zip(resources, plans, strict=True):
        out.write(f"# {resource['metadata']['name']}: {rendered.endpoint}\n")
        for reason in rendered.tuning.reasons():
            out.write(f"#   {reason}\n")
        for obj in rendered.objects:
            out.write("---\n")
            out.write(yaml.dump(obj, Dumper=_BlockDumper, sort_keys=False, width=100))


def write_table(resources: list[dict[str, Any]], plans: list[Rendered], out: TextIO) -> None:
    """The objects, and the tuned engine flags with the reason for each."""
    for resource, rendered in zip(resources, plans, strict=True):
        meta = resource["metadata"]
        out.write(f"{meta['name']} ({meta.get('namespace') or 'default'}): {rendered.endpoint}\n\n")
        rows = [(obj["kind"], obj["metadata"]["name"]) for obj in rendered.objects]
        out.write(_table(("KIND", "NAME"), rows))
        out.write("\n")
        out.write(_table(("ROLE", "FLAG", "VALUE", "REASON"), _tuning_rows(rendered.tuning)))
        out.write("\n")


def _tuning_rows(tuning: Tuning) -> list[tuple[str, ...]]:
    rows = []
    for role, role_tuning in tuning.roles.items():
        for name, choice in role_tuning.choices().items():
            value = f"{choice.value}" + (" (set)" if choice.user_set else "")
            rows.append((role, name, value, choice.reason))
    return rows


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, str(row[-1])]).rstrip())
    return "\n".join(lines) + "\n"
