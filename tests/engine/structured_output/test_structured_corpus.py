"""Every constraint of the corpus generates valid output on both backends; refused ones are
refused with a message that names the problem."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.engine.structured_output.corpus import BACKENDS, CORPUS
from tests.engine.structured_output.walk import walk
from tidegate.engine.sampling_params import StructuredOutputsParams
from tidegate.engine.structured_output import GrammarError
from tidegate.engine.tokenizer import Tokenizer

SEEDS = range(3)


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    """Decodes the walks as the engine's detokenizer would."""
    return Tokenizer(tiny_llama_dir)


def generate(backend, vocab, tokenizer, params: StructuredOutputsParams) -> list[str]:
    """The texts of random walks through the constraint, one per seed; each must end."""
    compiled = backend.compile(params)
    texts = []
    for seed in SEEDS:
        tokens, ended = walk(backend.new_matcher(compiled), vocab, seed)
        assert ended, f"seed {seed} did not end: {tokenizer.decode(tokens)!r}"
        texts.append(tokenizer.decode(tokens))
    return texts


@pytest.mark.parametrize("name", sorted(CORPUS["schemas"]))
def test_schema_outputs_validate(name: str, backend, vocab, tokenizer) -> None:
    schema = CORPUS["schemas"][name]
    params = StructuredOutputsParams(json=json.dumps(schema))
    for text in generate(backend, vocab, tokenizer, params):
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_outputs_are_objects(backend, vocab, tokenizer) -> None:
    for text in generate(backend, vocab, tokenizer, StructuredOutputsParams(json_object=True)):
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("regex", CORPUS["regexes"])
def test_regex_outputs_match(regex: str, backend, vocab, tokenizer) -> None:
    for text in generate(backend, vocab, tokenizer, StructuredOutputsParams(regex=regex)):
        assert re.fullmatch(regex, text), text


@pytest.mark.parametrize("choices", CORPUS["choices"], ids=lambda c: c[0])
def test_choice_outputs_are_one_of_the_choices(choices: list[str], backend, vocab, tokenizer):
    for text in generate(backend, vocab, tokenizer, StructuredOutputsParams(choice=choices)):
        assert text in choices


@pytest.mark.parametrize("grammar", CORPUS["grammars"], ids=lambda g: g["name"])
def test_grammar_outputs_parse(grammar: dict, backend, vocab, tokenizer) -> None:
    params = StructuredOutputsParams(grammar=grammar.get("ebnf") or grammar["lark"])
    for text in generate(backend, vocab, tokenizer, params):
        if grammar.get("check") == "python_expression":
            assert isinstance(ast.parse(text, mode="eval").body, ast.expr), text
        else:
            assert re.fullmatch(grammar["fullmatch"], text), text


def _refused_cases() -> list:
    cases = []
    for case in CORPUS["refused"]:
        for name in case.get("backends", BACKENDS):
            cases.append(pytest.param(case, name, id=f"{case['name']}-{name}"))
    return cases


@pytest.mark.parametrize(("case", "backend_name"), _refused_cases())
def test_refused_constraints_name_the_problem(case: dict, backend_name: str, backends) -> None:
    if "schema" in case:
        params = StructuredOutputsParams(json=json.dumps(case["schema"]))
    elif "json" in case:
        params = StructuredOutputsParams(json=case["json"])
    elif "regex" in case:
        params = StructuredOutputsParams(regex=case["regex"])
    else:
        params = StructuredOutputsParams(grammar=case["grammar"])
    with pytest.raises(GrammarError) as raised:
        backends[backend_name].compile(params)
    for word in case["words"]:
        assert word in str(raised.value), f"{word!r} not in {str(raised.value)!r}"


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS["schemas"]) >= 32
    assert sum("ebnf" in g for g in CORPUS["grammars"]) >= 3
