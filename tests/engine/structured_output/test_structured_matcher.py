"""What the engine relies on from a matcher: its masks, EOS handling, rollback and reset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.engine.structured_output.walk import EOS_ID, allowed_ids, walk
from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.structured_output import bitmask_words, create_backend
from tidegate.engine.structured_output.backend import MAX_JSON_WHITESPACE

OBJECT = StructuredOutputsParams(
    json=json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name", "n"],
            "additionalProperties": False,
        }
    )
)
SPECIAL_IDS = range(6)  # <pad> <s> </s> <|system|> <|user|> <|assistant|>


def mask(matcher, vocab) -> np.ndarray:
    """The matcher's next-token ids."""
    bitmask = np.full((2, bitmask_words(vocab.vocab_size)), -1, dtype=np.int32)
    matcher.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all(), "another row was written"
    return allowed_ids(bitmask[1], vocab.vocab_size)


def test_rollback_returns_to_the_same_state(backend, vocab) -> None:
    matcher = backend.new_matcher(backend.compile(OBJECT))
    tokens, ended = walk(matcher, vocab, seed=1)
    assert ended and len(tokens) > 4
    matcher.rollback(1)  # the EOS
    assert not matcher.ended and matcher.is_terminated()  # the object is closed: EOS must come
    replay = backend.new_matcher(backend.compile(OBJECT))
    masks = []
    for token in tokens:
        masks.append(mask(replay, vocab))
        assert replay.accept_token(token)
    masks.append(mask(replay, vocab))
    np.testing.assert_array_equal(mask(matcher, vocab), masks[-1])
    matcher.rollback(3)
    np.testing.assert_array_equal(mask(matcher, vocab), masks[-4])
    matcher.rollback(len(tokens) - 3)
    np.testing.assert_array_equal(mask(matcher, vocab), masks[0])
    with pytest.raises(ValueError, match="cannot roll back 1 tokens: 0 were accepted"):
        matcher.rollback(1)
    for token in tokens:  # the same path again
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS_ID) and matcher.is_terminated()


def test_refused_token_leaves_the_state_unchanged(backend, vocab) -> None:
    matcher = backend.new_matcher(backend.compile(OBJECT))
    before = mask(matcher, vocab)
    forbidden = next(t for t in range(6, vocab.tokenizer_size) if t not in before)
    assert not matcher.accept_token(forbidden)
    assert not matcher.accept_token(EOS_ID)  # nothing written yet
    np.testing.assert_array_equal(mask(matcher, vocab), before)
    assert walk(matcher, vocab, seed=0)[1]


def test_ids_beyond_the_tokenizer_are_never_allowed(backend, vocab) -> None:
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(json_object=True)))
    assert backend.vocab_size == vocab.vocab_size > vocab.tokenizer_size
    bitmask = np.full((1, bitmask_words(vocab.vocab_size)), -1, dtype=np.int32)
    matcher.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
    assert not bits[vocab.tokenizer_size :].any()  # the padding bits of the last word too
    for token in (vocab.tokenizer_size, vocab.vocab_size - 1, -1):
        assert not matcher.accept_token(token)


def test_special_tokens_are_never_text(backend, vocab) -> None:
    """A string may hold any text, but "<|user|>" there would vanish from the decoded output."""
    matcher = backend.new_matcher(
        backend.compile(StructuredOutputsParams(json='{"type": "string"}'))
    )
    assert matcher.accept_token(vocab.ids['"'])
    allowed = set(mask(matcher, vocab).tolist())
    assert len(allowed) > 500 and not allowed & set(SPECIAL_IDS)


def test_eos_is_allowed_once_the_output_is_complete(tiny_llama_dir, vocab) -> None:
    eos_ids = [EOS_ID, 5]
    for name in ("xgrammar", "guidance"):
        backend = create_backend(name, tiny_llama_dir, vocab.vocab_size, eos_ids)
        matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(regex="[0-9]+")))
        assert not set(eos_ids) & set(mask(matcher, vocab).tolist())
        assert matcher.accept_token(vocab.ids["7"])
        assert set(eos_ids) <= set(mask(matcher, vocab).tolist()), name
        assert not matcher.is_terminated()  # more digits may come
        assert matcher.accept_token(5) and matcher.is_terminated()
        assert mask(matcher, vocab).tolist() == eos_ids
        assert not matcher.accept_token(EOS_ID)


def test_terminated_when_nothing_but_eos_can_come(backend, vocab) -> None:
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(choice=["yes", "no"])))
    assert walk(matcher, vocab, seed=0)[1]
    matcher.rollback(1)
    assert matcher.is_terminated()  # "yes" or "no" is written: only EOS may follow
    assert mask(matcher, vocab).tolist() == [EOS_ID]
    matcher.reset()
    assert not matcher.is_terminated()
    assert EOS_ID not in mask(matcher, vocab)


def test_vocab_size_of_the_tokenizer_works_and_smaller_is_refused(tiny_llama_dir, vocab):
    for name in ("xgrammar", "guidance"):
        backend = create_backend(name, tiny_llama_dir, vocab.tokenizer_size, [EOS_ID])
        assert walk(backend.new_matcher(backend.compile(OBJECT)), vocab_at(vocab), seed=0)[1]
        with pytest.raises(ValueError, match="vocab_size 1000 is smaller than the tokenizer"):
            create_backend(name, tiny_llama_dir, 1000, [EOS_ID])
        with pytest.raises(ValueError, match="no EOS token id below the tokenizer's size"):
            create_backend(name, tiny_llama_dir, vocab.vocab_size, [vocab.vocab_size - 1])


def vocab_at(vocab):
    """The same vocabulary without padding."""
    unpadded = object.__new__(type(vocab))
    unpadded.__dict__.update(vocab.__dict__, vocab_size=vocab.tokenizer_size)
    unpadded.first_byte = vocab.first_byte[: vocab.tokenizer_size]
    return unpadded


def test_unknown_backend_names_the_choices(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="backend 'nope' is not known; choose auto, xgrammar or"):
        create_backend("nope", tiny_llama_dir, 1024, [EOS_ID])


def test_auto_is_the_measured_default(tiny_llama_dir) -> None:
    results = Path(__file__).parents[3] / "benchmarks" / "results" / "structured_backends.json"
    default = json.loads(results.read_text())["default"]
    assert create_backend("auto", tiny_llama_dir, 1024, [EOS_ID]).name == default


def test_missing_library_names_the_pip_extra(tiny_llama_dir, monkeypatch) -> None:
    for module in ("xgrammar", "tidegate.engine.structured_output.xgrammar_backend"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(ValueError, match=r"needs the xgrammar package.*pip install 'tidegate\["):
        create_backend("xgrammar", tiny_llama_dir, 1024, [EOS_ID])


def test_importing_the_package_loads_no_grammar_library_nor_torch() -> None:
    code = (
        "import sys, tidegate.engine.structured_output\n"
        "print([m for m in ('torch', 'xgrammar', 'llguidance', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bitmask_words() -> None:
    assert [bitmask_words(n) for n in (1, 32, 33, 32000, 1124)] == [1, 1, 2, 1000, 36]


def test_whitespace_between_json_tokens_is_bounded(backend, vocab) -> None:
    """A model that keeps writing blanks is made to go on with the JSON."""
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(json_object=True)))
    assert matcher.accept_token(vocab.ids["{"])
    blanks = 0
    while matcher.accept_token(vocab.ids["Ġ"]):  # one space
        blanks += 1
        assert blanks <= MAX_JSON_WHITESPACE
    assert blanks == MAX_JSON_WHITESPACE
    assert matcher.accept_token(vocab.ids["}"])
