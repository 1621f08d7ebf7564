"""Whose request it is and how urgent, as the API server tells the engine: the tenant (the
cache-salt header, else a digest of the API key, else anonymous) and vLLM's `priority`."""

from __future__ import annotations

import copy
import hashlib

import pytest

from tests.engine.entrypoints.fake_engine import MODEL, FakeEngine, SyncAPI
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.entrypoints.openai.auth import APIKeys

COMPLETION = {"model": MODEL, "prompt": "a", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}


def key_tenant(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def api_for(engine, tiny_llama_dir, **options) -> SyncAPI:
    app = build_app(engine, served_model_names=[MODEL], model_path=str(tiny_llama_dir), **options)
    return SyncAPI(app)


@pytest.mark.parametrize("body", [COMPLETION, CHAT], ids=["completion", "chat"])
@pytest.mark.parametrize(
    ("options", "headers", "tenant"),
    [
        ({"cache_salt_header": "x-tenant-id"}, {"X-Tenant-Id": "acme"}, "acme"),
        (
            {"cache_salt_header": "x-tenant-id", "api_key": "sk-one"},
            {"X-Tenant-Id": "acme", "Authorization": "Bearer sk-one"},
            "acme",
        ),
        (
            {"cache_salt_header": "x-tenant-id", "api_key": "sk-one"},
            {"Authorization": "Bearer sk-one"},
            key_tenant("sk-one"),
        ),
        ({"api_key": "sk-one"}, {"Authorization": "Bearer sk-one"}, key_tenant("sk-one")),
        # An open server checks no key: a client's Authorization names no tenant.
        ({}, {"Authorization": "Bearer anything"}, None),
        ({}, {}, None),
    ],
    ids=["header", "header-over-key", "key-without-header", "key", "open-server", "anonymous"],
)
def test_the_tenant_is_the_header_else_the_keys_digest_else_anonymous(
    engine, tiny_llama_dir, body, options, headers, tenant
):
    api = api_for(engine, tiny_llama_dir, **options)
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    assert api.post(path, body, headers=headers).status_code == 200
    [request] = engine.submitted
    assert request.tenant == tenant
    assert "sk-one" not in str(request.tenant)


def test_two_keys_are_two_tenants(engine, tiny_llama_dir):
    api = api_for(engine, tiny_llama_dir, api_key=APIKeys(["sk-one", "sk-two"]))
    for key in ("sk-one", "sk-two", "sk-one"):
        headers = {"Authorization": f"Bearer {key}"}
        assert api.post("/v1/completions", COMPLETION, headers=headers).status_code == 200
    tenants = [request.tenant for request in engine.submitted]
    assert tenants == [key_tenant("sk-one"), key_tenant("sk-two"), key_tenant("sk-one")]


@pytest.fixture
def priority_engine(tiny_input_processor) -> FakeEngine:
    processor = copy.copy(tiny_input_processor)
    processor.priority_scheduling = True
    return FakeEngine(processor.tokenizer, processor)


@pytest.mark.parametrize("body", [COMPLETION, CHAT], ids=["completion", "chat"])
def test_priority_reaches_the_engine_under_the_priority_policy(
    priority_engine, tiny_llama_dir, body
):
    api = api_for(priority_engine, tiny_llama_dir)
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    for priority in (-3, 0, 7):
        assert api.post(path, dict(body, priority=priority)).status_code == 200
    assert [r.priority for r in priority_engine.submitted] == [-3, 0, 7]


def test_a_priority_other_policies_would_ignore_is_refused_naming_the_flag(api, engine):
    response = api.post("/v1/completions", dict(COMPLETION, priority=1))
    assert response.status_code == 400
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    assert not engine.submitted
    assert api.post("/v1/completions", dict(COMPLETION, priority=0)).status_code == 200


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, "high", 1.5])
def test_a_priority_that_cannot_reach_the_engine_is_a_400(
    priority_engine, tiny_llama_dir, priority
):
    api = api_for(priority_engine, tiny_llama_dir)
    response = api.post("/v1/completions", dict(COMPLETION, priority=priority))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"
    assert not priority_engine.submitted
