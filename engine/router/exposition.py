"""Reading an engine's /metrics: the Prometheus text format, one sample line at a time.

The router reads a few gauges out of a page it does not control (an engine of another
version, a vLLM server, a sidecar's additions), so a line it cannot parse is skipped, not
fatal: losing one sample must not lose the instance's load or adapters with it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger("tidegate.router")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# A quoted label value: anything but a quote or a backslash, or a backslash and any character.
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One series' value: `name{labels} value`."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass
class Exposition:
    """The samples of a /metrics page, and the metric names it declares (# HELP, # TYPE)."""

    samples: list[Sample] = field(default_factory=list)
    declared: set[str] = field(default_factory=set)

    def series(self, name: str) -> list[Sample]:
        """The samples of one metric name."""
        return [sample for sample in self.samples if sample.name == name]

    def knows(self, name: str) -> bool:
        """Whether the page has the metric at all: declared, or with a sample.

        A labelled gauge with no series yet is still declared (prometheus_client writes its
        HELP and TYPE), which tells "exported, currently empty" from "not exported".
        """
        return name in self.declared or any(sample.name == name for sample in self.samples)


def parse_exposition(text: str, names: Collection[str] | None = None) -> Exposition:
    """Every sample line of the text that parses (of `names` only, if given); bad ones skipped.

    With `names`, the lines of other metrics (an engine's many histogram buckets) are passed
    over after reading their name, which keeps a scrape cheap for the router's event loop.
    """
    page = Exposition()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            words = line.split(maxsplit=3)
            if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                page.declared.add(words[2])
            continue
        if names is not None:
            match = _NAME.match(line)
            if match is None or match.group() not in names:
                continue
        try:
            page.samples.append(_parse_sample(line))
        except ValueError as error:
            logger.debug("skipping a /metrics line (%s): %.200r", error, line)
    return page


def _parse_sample(line: str) -> Sample:
    match = _NAME.match(line)
    if match is None:
        raise ValueError("no metric name")
    name, at = match.group(), match.end()
    labels: dict[str, str] = {}
    if at < len(line) and line[at] == "{":
        labels, at = _parse_labels(line, at + 1)
    rest = line[at:].split()
    # The value, then an optional timestamp (ignored: the router wants the current value).
    if not rest or len(rest) > 2 or line[at : at + 1] not in (" ", "\t"):
        raise ValueError("no value after the name and labels")
    return Sample(name, labels, float(rest[0]))


def _parse_labels(line: str, at: int) -> tuple[dict[str, str], int]:
    """The labels from just after `{`, and the index just after the closing `}`."""
    labels: dict[str, str] = {}
    while True:
        at = _skip_spaces(line, at)
        if line[at : at + 1] == "}":
            return labels, at + 1
        match = _LABEL_NAME.match(line, at)
        if match is None:
            raise ValueError("a bad label name")
        at = _skip_spaces(line, match.end())
        if line[at : at + 1] != "=":
            raise ValueError("no = after a label name")
        at = _skip_spaces(line, at + 1)
        value, at = _parse_quoted(line, at)
        labels[match.group()] = value
        at = _skip_spaces(line, at)
        if line[at : at + 1] == ",":
            at += 1  # a trailing comma before } is allowed
        elif line[at : at + 1] != "}":
            raise ValueError("no , or } after a label")


def _parse_quoted(line: str, at: int) -> tuple[str, int]:
    """A label value from its opening quote, and the index just after its closing one."""
    match = _QUOTED.match(line, at)
    if match is None:
        raise ValueError("an unquoted or unterminated label value")
    # The format escapes only \\, \" and \n; any other backslash is kept as written.
    value = _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group()), match.group(1))
    return value, match.end()


def _skip_spaces(line: str, at: int) -> int:
    while line[at : at + 1] in (" ", "\t"):
        at += 1
    return at
