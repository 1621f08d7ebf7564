"""Structured outputs through the offline engine on the tiny random model: constrained outputs
validate, free requests are untouched by constrained neighbours, and preemption, chunked
prefill, async scheduling, seeds and refusals keep every output valid and every block freed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tidegate.engine import LLM, SamplingParams
from tidegate.engine.errors import RequestRefusedError
from tidegate.engine.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "ok": {"type": "boolean"},
        },
        "required": ["x", "ok"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 4,
}


def json_params(schema: dict, **kwargs) -> SamplingParams:
    constraint = StructuredOutputsParams(json=json.dumps(schema))
    return SamplingParams(
        max_tokens=kwargs.pop("max_tokens", 300), structured_outputs=constraint, **kwargs
    )


def prompt(i: int) -> str:
    # Text, not random token ids: a prompt that ends inside a UTF-8 character would have the
    # detokenizer put the rest of that character before the output's first token.
    return f"Request {i}: answer in the format asked for, about item {i * 37 % 101}."


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def assert_nothing_leaked(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", max_model_len=1024, num_gpu_blocks=200
    ) as engine:
        yield engine


def test_json_regex_and_choice_outputs_are_valid_greedy_and_sampled(llm):
    requests = [
        (json_params(PERSON, temperature=0), PERSON),
        (json_params(POINTS, temperature=0), POINTS),
        (json_params(PERSON, temperature=1.0, seed=3), PERSON),
        (json_params(POINTS, temperature=0.8, top_p=0.9, seed=5), POINTS),
    ]
    regex = r"(\d{3}-\d{4}|[a-z]{2,5}@[a-z]{2,4}\.(com|org))"
    choices = ["yes", "no", "maybe later"]
    extra = [
        SamplingParams(
            temperature=1.0, seed=8, structured_outputs=StructuredOutputsParams(regex=regex)
        ),
        SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(  # a seed whose object closes within max_tokens on the random model
            temperature=1.0,
            seed=13,
            structured_outputs=StructuredOutputsParams(json_object=True),
            max_tokens=300,
        ),
    ]
    params = [p for p, _ in requests] + extra
    outputs = llm.generate([prompt(i) for i in range(len(params))], params)
    for output, (_, schema) in zip(outputs, requests, strict=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert_valid(completion.text, schema)
    regex_out, choice_out, object_out = (o.outputs[0] for o in outputs[len(requests) :])
    assert re.fullmatch(regex, regex_out.text)
    assert choice_out.text in choices
    assert isinstance(json.loads(object_out.text), dict)
    assert_nothing_leaked(llm)


def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm):
    free = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
    ]
    alone = llm.generate([prompt(40), prompt(41)], free)
    mixed = llm.generate(
        [prompt(40), prompt(50), prompt(41), prompt(51)],
        [free[0], json_params(PERSON, temperature=0), free[1], json_params(POINTS, seed=2)],
    )
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert_valid(mixed[1].outputs[0].text, PERSON)
    assert_valid(mixed[3].outputs[0].text, POINTS)


def test_seeded_constrained_requests_repeat(llm):
    params = json_params(POINTS, temperature=1.0, seed=21)
    first = llm.generate([prompt(3)], params)[0].outputs[0]
    again = llm.generate([prompt(3)], params)[0].outputs[0]
    assert first.token_ids == again.token_ids
    assert_valid(first.text, POINTS)


def test_a_grammar_that_cannot_finish_ends_by_length(llm):
    out = llm.generate([prompt(5)], json_params(POINTS, temperature=0, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert_nothing_leaked(llm)


def test_an_invalid_constraint_is_refused_and_leaves_nothing_behind(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "nope"}'))
    with pytest.raises(RequestRefusedError, match="nope"):
        llm.generate([prompt(1), prompt(2)], [SamplingParams(max_tokens=8), bad])
    assert_nothing_leaked(llm)
    bad_regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(RequestRefusedError):
        llm.generate([prompt(1)], bad_regex)
    assert_nothing_leaked(llm)
    # The engine still serves.
    assert llm.generate([prompt(1)], json_params(PERSON, temperature=0))[0].outputs[0].text


def test_preemption_on_a_tight_pool_keeps_outputs_valid(tiny_llama_dir):
    # 32 blocks of 16 tokens for 8 requests that each grow to 100-200 tokens: some are preempted
    # and recomputed, their matchers keep their state.
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", max_model_len=512, num_gpu_blocks=32
    ) as tight:
        schemas = [PERSON, POINTS] * 4
        params = [
            json_params(s, temperature=1.0, seed=i, max_tokens=480) for i, s in enumerate(schemas)
        ]
        outputs = tight.generate([prompt(60 + i) for i in range(8)], params)
        assert tight.stats()["num_preemptions"] > 0
        for output, schema in zip(outputs, schemas, strict=True):
            assert output.outputs[0].finish_reason == "stop"
            assert_valid(output.outputs[0].text, schema)
        assert_nothing_leaked(tight)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prefill_and_async_scheduling_give_the_same_constrained_tokens(
    tiny_llama_dir, llm, async_scheduling
):
    long_prompt = " ".join(f"word{j}" for j in range(60))  # about 150 tokens
    params = [json_params(PERSON, temperature=0), json_params(POINTS, temperature=1.0, seed=4)]
    reference = llm.generate([long_prompt, prompt(7)], params)
    with LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks=200,
        max_num_batched_tokens=64,  # the long prompt is computed in three chunks
        async_scheduling=async_scheduling,
    ) as chunked:
        outputs = chunked.generate([long_prompt, prompt(7)], params)
    for got, want in zip(outputs, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
