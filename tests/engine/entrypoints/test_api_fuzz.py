"""schemathesis against the app's own OpenAPI document: no 5xx, and every answer is documented.

Every operation of /openapi.json is fuzzed in process over the scripted engine, with the API
key on, with schema-valid bodies (positive) and schema-violating ones (negative). Besides our
own check (2xx or 4xx, every error in OpenAI's body), schemathesis' default checks run: status
codes, content types, headers and bodies as documented, schema-violating input refused, the API
key enforced (`ignored_auth`), unsupported methods answered 405.

One default check is off, `positive_data_acceptance` ("a schema-valid request gets a 2xx"):
the server rightly refuses schema-valid requests for reasons JSON Schema cannot state, such as a
model name it does not serve, a prompt longer than the context, a token id outside the
vocabulary, min_tokens above max_tokens, or a sampling value outside its range.
"""

from __future__ import annotations

import hypothesis.core
import hypothesis.internal.conjecture.engine
import hypothesis.strategies._internal.collections
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.engine.entrypoints.fake_engine import MODEL
from tests.engine.entrypoints.request_fuzz import assert_error_body
from tidegate.engine.entrypoints.openai.api_server import build_app

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# (method, path, takes a body): a body can be made schema-violating, the other inputs cannot.
OPERATIONS = [
    ("POST", "/v1/completions", True),
    ("POST", "/v1/chat/completions", True),
    ("POST", "/v1/embeddings", True),
    ("POST", "/v1/classify", True),
    ("POST", "/v1/score", True),
    ("POST", "/v1/rerank", True),
    ("POST", "/tokenize", True),
    ("POST", "/detokenize", True),
    ("GET", "/v1/models", False),
    ("GET", "/v1/models/{name}", False),
    ("GET", "/health", False),
    ("GET", "/metrics", False),
    ("GET", "/version", False),
]
CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode.value}")
    for method, path, has_body in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if has_body or mode is GenerationMode.POSITIVE
]
# Enough to reach every field of the bodies a few times; the whole file stays under a minute.
FUZZ_SETTINGS = settings(
    max_examples=60,
    deadline=None,  # the first request of a run pays for imports and the chat template
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# What schemathesis changes in Hypothesis, for its own speed, once it generates a case
# (schemathesis/generation/hypothesis/__init__.py): no failing example printed, bigger buffers.
_PATCHED_BY_SCHEMATHESIS = [
    (hypothesis.core, "RepresentationPrinter"),
    (hypothesis.core, "BUFFER_SIZE"),
    (hypothesis.internal.conjecture.engine, "BUFFER_SIZE"),
    (hypothesis.strategies._internal.collections, "BUFFER_SIZE"),
]


@pytest.fixture(autouse=True, scope="module")
def _hypothesis_as_it_was():
    """Hypothesis as it was before this module, for the tests after it."""
    saved = [
        (m, name, getattr(m, name)) for m, name in _PATCHED_BY_SCHEMATHESIS if hasattr(m, name)
    ]
    yield
    for module, name, value in saved:
        setattr(module, name, value)


@pytest.fixture
def api_schema(engine, tiny_llama_dir):
    app = build_app(
        engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), api_key=API_KEY
    )
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)


def openai_status_and_error_body(ctx, response, case) -> None:
    """A 2xx, or a 4xx whose body is OpenAI's error object with a message."""
    status = response.status_code
    assert 200 <= status < 300 or 400 <= status < 500, f"status {status}: {response.text}"
    if status >= 400:
        assert_error_body(response.json())


def test_every_operation_of_the_document_is_fuzzed(api_schema):
    documented = {
        (operation.ok().method.upper(), operation.ok().path)
        for operation in api_schema.get_all_operations()
    }
    assert documented == {(method, path) for method, path, _ in OPERATIONS}


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_schemathesis(api_schema, method, path, mode):
    operation = api_schema[path][method]

    # Half the positive bodies name the served model, or nearly all would stop at the 404.
    @given(case=operation.as_strategy(generation_mode=mode), served=st.booleans())
    @FUZZ_SETTINGS
    def run(case, served):
        positive = mode is GenerationMode.POSITIVE
        if positive and served and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        case.call_and_validate(
            headers=AUTH,
            additional_checks=[openai_status_and_error_body],
            excluded_checks=[positive_data_acceptance],
        )

    run()
