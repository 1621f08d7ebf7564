"""Server-sent events stay one line each, whatever text the model generates."""

from __future__ import annotations

import json

import pytest

from tidegate.engine.entrypoints.openai.responses import CompletionChoice, CompletionResponse
from tidegate.engine.entrypoints.openai.sse import sse_event

# Characters JSON leaves as they are but str.splitlines() breaks lines at.
UNICODE_LINE_BREAKS = "\x85\u2028\u2029"


@pytest.mark.parametrize("as_model", [True, False], ids=["chunk", "error body"])
def test_an_event_with_unicode_line_breaks_in_its_text_is_one_line(as_model):
    # A byte-level model can generate any of them; a client reading the stream with httpx's
    # aiter_lines (str.splitlines) must still see one `data:` line per event.
    text = f"a{UNICODE_LINE_BREAKS}b\x0b\x1cc"
    choice = CompletionChoice(index=0, text=text, finish_reason=None)
    chunk = CompletionResponse(id="cmpl-1", created=0, model="tiny", choices=[choice])
    payload = chunk if as_model else {"error": {"message": text}}

    lines = sse_event(payload).splitlines()

    assert lines[1:] == [""]
    assert lines[0].startswith("data: ")
    decoded = json.loads(lines[0][len("data: ") :])
    assert (decoded["choices"][0]["text"] if as_model else decoded["error"]["message"]) == text
