"""The manager compiles off the caller's thread, caches by constraint, and fills batches."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from tests.engine.structured_output.walk import Vocab, walk
from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.structured_output import GrammarError, StructuredOutputManager, manager
from tidegate.engine.structured_output.backend import StructuredOutputBackend

DEADLINE_S = 30


class FakeBackend(StructuredOutputBackend):
    """Compiles to (regex, compiling thread) after `gate` opens; "(" is invalid."""

    name = "fake"
    vocab_size = 100

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()  # a compile has begun
        self.compiles: list[str] = []

    def compile(self, params: StructuredOutputsParams):
        self.started.set()
        assert self.gate.wait(DEADLINE_S)
        self.compiles.append(params.regex)
        if params.regex == "(":
            raise GrammarError("regex: unbalanced parenthesis")
        return (params.regex, threading.current_thread())

    def new_matcher(self, compiled):
        raise NotImplementedError

    _compile_json = _compile_json_object = _compile_regex = new_matcher
    _compile_choice = _compile_grammar = new_matcher


def regex(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=text)


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


def test_compiles_on_another_thread_and_caches_by_key(fake) -> None:
    grammars = StructuredOutputManager(fake)
    fake.gate.clear()
    first = grammars.compile_async(regex("a+"))
    second = grammars.compile_async(regex("a+"))  # still compiling: the same future
    assert second is first and not first.done()
    fake.gate.set()
    compiled, thread = first.result(DEADLINE_S)
    assert thread is not threading.current_thread()
    third = grammars.compile_async(regex("a+"))
    assert third is first and third.result()[0] is compiled
    assert (grammars.cache_hits, grammars.cache_misses) == (2, 1)
    assert fake.compiles == ["a+"]
    grammars.shutdown()


def test_least_recently_used_grammars_are_dropped(fake) -> None:
    grammars = StructuredOutputManager(fake, max_cached_grammars=2)
    for text in ("a", "b", "a", "c"):  # "a" used again: "b" is the oldest
        grammars.compile_async(regex(text)).result(DEADLINE_S)
    grammars.compile_async(regex("a")).result(DEADLINE_S)
    grammars.compile_async(regex("b")).result(DEADLINE_S)
    assert fake.compiles == ["a", "b", "c", "b"]
    assert (grammars.cache_hits, grammars.cache_misses) == (2, 4)
    grammars.shutdown()


def test_a_failed_compile_answers_again_then_is_forgotten(fake, monkeypatch) -> None:
    grammars = StructuredOutputManager(fake)
    with pytest.raises(GrammarError, match="unbalanced parenthesis"):
        grammars.compile_async(regex("(")).result(DEADLINE_S)
    again = grammars.compile_async(regex("("))
    assert again.done() and isinstance(again.exception(), GrammarError)
    assert fake.compiles == ["("]
    monkeypatch.setattr(manager, "FAILED_COMPILE_TTL_S", 0.0)
    with pytest.raises(GrammarError):
        grammars.compile_async(regex("(")).result(DEADLINE_S)
    assert fake.compiles == ["(", "("]
    grammars.compile_async(regex("a")).result(DEADLINE_S)  # drops the expired failure
    assert len(grammars._cache) == 1
    grammars.shutdown()


def test_shutdown_cancels_compiles_not_started(fake) -> None:
    grammars = StructuredOutputManager(fake)
    fake.gate.clear()
    running = grammars.compile_async(regex("a"))
    queued = grammars.compile_async(regex("b"))
    assert fake.started.wait(DEADLINE_S)  # "a" is on the thread, "b" waits in the queue
    grammars.shutdown()
    fake.gate.set()
    assert running.result(DEADLINE_S)[0] == "a"
    assert queued.cancelled()
    with pytest.raises(RuntimeError):
        grammars.compile_async(regex("c"))


def test_allocate_and_check_the_bitmask(fake) -> None:
    grammars = StructuredOutputManager(fake)
    bitmask = grammars.allocate_bitmask(3)
    assert bitmask.shape == (3, 4) and bitmask.dtype == np.int32 and (bitmask == -1).all()
    with pytest.raises(ValueError, match="bitmask must be int32 with at least 4 rows"):
        grammars.fill_bitmasks([None] * 4, bitmask)
    with pytest.raises(ValueError, match="must be at least 1"):
        StructuredOutputManager(fake, max_cached_grammars=0)
    grammars.shutdown()


def test_batch_fill_equals_one_by_one(backend, vocab: Vocab, monkeypatch) -> None:
    """Large batches go to the library's threads: the rows must be those of single fills."""
    monkeypatch.setattr(sys.modules[type(backend).__module__], "BATCH_FILL_MIN", 2)
    grammars = StructuredOutputManager(backend)
    constraints = [
        StructuredOutputsParams(json='{"type": "array", "items": {"type": "integer"}}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="[a-z]+@[a-z]+"),
        StructuredOutputsParams(choice=["yes", "no"]),
    ]
    matchers = []
    for seed, params in enumerate(constraints * 2):
        matcher = grammars.new_matcher(grammars.compile_async(params).result(DEADLINE_S))
        tokens, ended = walk(matcher, vocab, seed)
        matcher.rollback(min(len(tokens) + ended, seed))  # some ended, some midway
        matchers.append(matcher)
    assert any(m.ended for m in matchers) and not all(m.ended for m in matchers)
    batch = grammars.allocate_bitmask(len(matchers) + 1)
    grammars.fill_bitmasks(matchers, batch)
    single = grammars.allocate_bitmask(len(matchers) + 1)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(single, row)
    np.testing.assert_array_equal(batch, single)
    assert (batch[-1] == -1).all()
    grammars.shutdown()
