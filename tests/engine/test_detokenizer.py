"""Incremental detokenization: equal to a full decode, and stop strings never leak."""

from __future__ import annotations

import pytest

from tidegate.engine.detokenizer import IncrementalDetokenizer
from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.tokenizer import Tokenizer

TEXTS = [
    "The tide comes in at six; the servers hum along.",
    "Ünïcödé — 東京 and émoji 🌊🌊 split across byte-level tokens.",
    "def f(x):\n    return x * 2  # code, too\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt, generated = ids[:3], ids[3:]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt)
    pieces = []
    for token_id in generated:
        detok.update([token_id])
        pieces.append(detok.text_delta(finished=False))
    pieces.append(detok.text_delta(finished=True))
    expected = tokenizer.decode(generated)
    assert detok.output_text == expected
    assert "".join(pieces) == expected


def test_stop_string_cuts_text_and_is_never_streamed(tokenizer):
    text = "alpha beta STOP gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["STOP", "zzz"]), [1])
    streamed = ""
    stop = None
    for token_id in ids:
        stop = detok.update([token_id])
        streamed += detok.text_delta(finished=stop is not None)
        if stop:
            break
    assert stop == "STOP"
    assert detok.output_text == "alpha beta "
    assert streamed == "alpha beta "


def test_stop_string_kept_when_asked(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    params = SamplingParams(stop=["two"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, params, [1])
    for token_id in ids:
        if detok.update([token_id]):
            break
    assert detok.output_text == "one two"


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text.startswith("<s>")
    assert "Be brief." in text and "Hi" in text
    assert text.rstrip().endswith("<|assistant|>")
